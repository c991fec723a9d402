"""Inspect a Redis/Valkey tier (``kvtier redis inspect``): namespaces, keys, bytes.

:class:`~kvtier.tiers.redis_tier.RedisTier` stores a block under
``kvtier:<namespace>:<block key bytes>``. Those keys are found with ``SCAN 0
MATCH kvtier:* COUNT n``, page by page (never ``KEYS``, which stalls the server
for the whole key space), and each page's values are measured with one
pipelined ``STRLEN`` per key: the exact bytes of the stored values (header and
payload), not the server's own overhead per key (which ``MEMORY USAGE`` would
add). ``SCAN`` may return a key twice while the server resizes its hash table,
and keys come and go while it runs, so the counts of a busy server are close,
not exact.

The connection is a ``RedisTier``'s, with its URL handling: the password from the
URL or ``$KVTIER_REDIS_PASSWORD``, TLS for ``rediss://``, the same timeouts; every
message names the URL with the password replaced by ``***``. Redis Cluster URLs
are refused: inspect each shard's own URL.

Memory: one SCAN page of keys at a time, and a counter per namespace (at most
:data:`MAX_NAMESPACES`; the keys of further namespaces are counted together,
as ``overflow``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from redis.exceptions import RedisClusterException, RedisError, ResponseError

from kvtier.secrets import HIDDEN_QUERY_KEYS
from kvtier.tiers.base import TierConfigError, TierUnavailableError
from kvtier.tiers.namespace import check_namespace
from kvtier.tiers.redis_tier import DEFAULT_PASSWORD_ENV, RedisTier
from kvtier.tools import AdminError

KEY_PREFIX = b"kvtier:"
"""RedisTier's default ``key_prefix`` and its separator."""
DEFAULT_SCAN_COUNT = 1000
MAX_NAMESPACES = 10_000
"""Namespaces counted one by one; the keys of further ones count together, in
``RedisReport.overflow``."""
BYTES_METHOD = "STRLEN"
_PROBE_NAMESPACE = "kvtier-admin"
"""RedisTier needs a namespace; the tool never reads or writes under it."""


@dataclass
class RedisNamespace:
    """Keys and value bytes under one namespace."""

    namespace: str
    keys: int = 0
    value_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"namespace": self.namespace, "keys": self.keys, "value_bytes": self.value_bytes}


@dataclass
class RedisReport:
    """``kvtier redis inspect``'s result."""

    url: str
    """The URL with its password redacted."""
    server: dict[str, Any]
    scan_count: int
    namespaces: dict[str, RedisNamespace] = field(default_factory=dict)
    other_keys: int = 0
    """``kvtier:*`` keys that are not ``kvtier:<namespace>:<key>`` string values."""
    overflow: RedisNamespace = field(default_factory=lambda: RedisNamespace("overflow"))
    """Keys and value bytes of the namespaces met after the first
    :data:`MAX_NAMESPACES` (kvtier blocks, not counted one namespace at a time)."""
    scan_calls: int = 0
    db_keys: int | None = None

    def sorted_namespaces(self) -> list[RedisNamespace]:
        """The namespaces by name."""
        return [self.namespaces[name] for name in sorted(self.namespaces)]

    def total(self) -> RedisNamespace:
        """The sum over the namespaces counted one by one (``overflow`` apart)."""
        total = RedisNamespace("total")
        for ns in self.namespaces.values():
            total.keys += ns.keys
            total.value_bytes += ns.value_bytes
        return total

    def to_dict(self) -> dict[str, Any]:
        """The report as one JSON-ready object."""
        total = self.total().to_dict()
        del total["namespace"]
        return {
            "url": self.url,
            "server": self.server,
            "namespaces": [ns.to_dict() for ns in self.sorted_namespaces()],
            "total": {"namespaces": len(self.namespaces), **total},
            "other_keys": self.other_keys,
            "overflow": {"after_namespaces": MAX_NAMESPACES, "keys": self.overflow.keys,
                         "value_bytes": self.overflow.value_bytes},
            "bytes_method": BYTES_METHOD,
            "scan": {"match": (KEY_PREFIX + b"*").decode(), "count": self.scan_count,
                     "calls": self.scan_calls},
            "db_keys": self.db_keys,
        }


PageCallback = Callable[[int, "RedisReport"], None]
"""Called after each SCAN page with its number of keys and the report so far."""


def inspect_redis(url: str, *, scan_count: int = DEFAULT_SCAN_COUNT,
                  password_env: str | None = DEFAULT_PASSWORD_ENV,
                  timeout_s: float = 5.0, on_page: PageCallback | None = None) -> RedisReport:
    """Count kvtier's keys and value bytes per namespace on the server at ``url``
    (``on_page``: told after each SCAN page, for a progress display).

    Raises :class:`~kvtier.tools.AdminError` (URL redacted) for a bad URL, a
    cluster URL, or a server that cannot be reached or fails meanwhile.
    """
    tier = _open_tier(url, password_env, timeout_s)
    secrets = _secrets(url, password_env)
    try:
        report = RedisReport(tier.safe_url, tier.check(), scan_count)
        client = tier._client()  # the tier's own client: same URL, auth, TLS, timeouts
        report.db_keys = int(client.dbsize())
        _scan(client, report, on_page)
        return report
    except TierUnavailableError as exc:
        raise AdminError(_scrub(f"cannot reach Redis: {exc}", secrets)) from None
    except (RedisError, RedisClusterException, OSError) as exc:
        raise AdminError(_scrub(f"redis {tier.safe_url}: {type(exc).__name__}: {exc}",
                                secrets)) from None
    finally:
        tier.close()


def _open_tier(url: str, password_env: str | None, timeout_s: float) -> RedisTier:
    try:
        tier = RedisTier(url, _PROBE_NAMESPACE, password_env=password_env,
                         socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
    except TierConfigError as exc:
        raise AdminError(str(exc)) from None
    if tier.cluster:
        tier.close()
        raise AdminError(f"{tier.safe_url}: Redis Cluster is not supported here; inspect "
                         "each shard with its own redis:// or rediss:// URL")
    return tier


def _scan(client: Any, report: RedisReport, on_page: PageCallback | None) -> None:
    """SCAN every page of ``kvtier:*`` and count it into ``report``."""
    cursor = 0
    while True:
        cursor, page = client.scan(cursor=cursor, match=KEY_PREFIX + b"*",
                                   count=report.scan_count)
        report.scan_calls += 1
        if page:
            _count_page(client, page, report)
        if on_page is not None:
            on_page(len(page), report)
        if int(cursor) == 0:
            return


def _count_page(client: Any, keys: list[bytes], report: RedisReport) -> None:
    """One pipelined STRLEN per key of a page; count each under its namespace."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    lengths = pipe.execute(raise_on_error=False)
    for key, length in zip(keys, lengths, strict=True):
        if isinstance(length, ResponseError):
            if not str(length).startswith("WRONGTYPE"):
                raise length  # NOPERM (an ACL), MOVED (a cluster replica)...: not counted
            report.other_keys += 1  # not a string: not a kvtier value
        elif isinstance(length, int) and length > 0:  # 0: removed since the SCAN
            ns = _namespace_of(key, report)
            if ns is None:
                report.other_keys += 1
            else:
                ns.keys += 1
                ns.value_bytes += length


def _namespace_of(key: bytes, report: RedisReport) -> RedisNamespace | None:
    """The counter of ``kvtier:<namespace>:<key>``'s namespace (``report.overflow``
    once :data:`MAX_NAMESPACES` namespaces have their own; None: not that form)."""
    name_bytes, sep, rest = key[len(KEY_PREFIX):].partition(b":")
    if not sep or not rest:
        return None
    try:
        name = check_namespace(name_bytes.decode("ascii"))
    except ValueError:  # UnicodeDecodeError included
        return None
    ns = report.namespaces.get(name)
    if ns is None:
        if len(report.namespaces) >= MAX_NAMESPACES:
            return report.overflow  # a kvtier block all the same: counted, not shown alone
        ns = report.namespaces[name] = RedisNamespace(name)
    return ns


def _secrets(url: str, password_env: str | None) -> list[str]:
    """Passwords that must never appear in a message."""
    found = []
    try:
        parts = urlsplit(url)
        found.append(parts.password or "")
        found += [v for k, v in parse_qsl(parts.query) if k.lower() in HIDDEN_QUERY_KEYS]
    except ValueError:
        pass
    if password_env is not None:
        found.append(os.environ.get(password_env, ""))
    return [s for s in found if s]


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
