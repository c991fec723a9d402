"""The Redis/Valkey tier: checksummed values under namespaced keys.

Each block is one string value, ``blockfile`` header + payload, stored under
``<key_prefix>:<namespace>:<block key bytes>``; reads check the header and the
checksum, and a bad value is a miss, deleted (unless a fresh copy replaced
it meanwhile), counted (``corrupt``) and reported (a ``corrupt`` event, unless
the key holds a fresh copy). A bad value the server would not let this
client delete (refused, failed, breaker open) stays: it is counted in
``corrupt_kept`` instead, with no event, and found again by the next read (a
delete that timed out may still have run: the value is then simply gone).
``get_into`` wants a payload of exactly its buffer's size (a CPU slot; the
namespace fixes a block's size): a valid value of another length is a bad
value too (``wrong length``), never a hit. All batch calls are
pipelined: ``contains`` asks up to ``MAX_EXISTS_KEYS`` keys a round trip, the
others send one batch of up to ``max_batch_keys`` keys / ``max_batch_bytes``
bytes a round trip, which also bounds the memory a call holds, as long
as the values are of the sizes asked for: GET reads a value whole before its
length can be checked, so one that another client made larger, up to the
server's ``proto-max-bulk-len``, is held whole before it is refused; the
commands that would read a length first, STRLEN or GETRANGE, are not in the
ACL kvtier documents).

URLs: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS; options
such as ``?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem`` in the query or in
``client_options``), ``unix:///path.sock``, and ``redis+cluster://host:port`` /
``rediss+cluster://`` (or ``cluster=True``) for Redis Cluster through redis-py's
cluster client (keys spread over all shards). The password comes from the URL
or, when the URL has none, from the environment variable named by
``password_env`` (default ``KVTIER_REDIS_PASSWORD``). It is never logged:
logs, errors and ``repr`` show the URL with the password replaced by ``***``.
TLS verifies the server's certificate and host name by default (the system's
CAs, or ``ssl_ca_certs``). The options are checked when the tier is built: a
misspelt or invalid one (``ssl_ca_cert=``) is a :class:`TierConfigError` then.

Capacity: the server's. Give it ``maxmemory`` and ``maxmemory-policy
allkeys-lru`` (or ``volatile-lru`` when ``ttl_s`` is set, so only kvtier's keys
are evicted): the server then evicts the least recently used blocks. Under
``noeviction`` a full server refuses SETs (OOM): those stores are dropped and
counted, the tier keeps serving reads. ``ttl_s`` gives every value an expiry.
A server without ``maxmemory`` (Debian's default) or under ``noeviction`` gets
one warning, when the tier first reaches it (or ``check()`` runs), naming the
fix; a server that refuses INFO gets none, and neither fails the tier.

Failures: every call has ``socket_timeout_s`` (and ``connect_timeout_s``), and
redis-py's own retries are off. Resolving the server's host name, which
redis-py does for every new connection, is bounded by the system resolver's
own timeouts only: the cascade makes its calls on I/O threads, but with
``redis_async_lookups`` off a lookup's connection is made on the scheduler's
thread (give an IP address, or a resolver that answers locally, there).
Transport failures (connection refused or
reset, timeouts, auth failures, cluster down) feed a :class:`CircuitBreaker`:
after ``failure_threshold`` in a row it opens; while open the tier reports
misses and drops stores without touching the network; after
``reset_timeout_s`` (doubling per failed probe up to ``max_reset_timeout_s``)
one call probes the server and closes the breaker when it succeeds (a slow
call let through before the breaker opened does not close it). The
warning logged when it opens names the last failure (e.g. a TLS certificate
that failed verification, a refused password), secrets redacted.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    InvalidResponse,
    MaxConnectionsError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvtier.secrets import (
    HIDDEN_QUERY_KEYS,
    MISPLACED_AT_HINT,
    REDIS_PASSWORD_ENV,
    REDIS_URL_SCHEMES,
    misplaced_at,
    redact_url,
)
from kvtier.tiers import blockfile
from kvtier.tiers.base import (
    DEFAULT_MAX_TIER_EVENTS,
    Counters,
    Tier,
    TierConfigError,
    TierEvent,
    TierEventLog,
    TierUnavailableError,
    WarningLimiter,
    check_batch,
    check_buffers,
    check_items,
    seconds_setting,
)
from kvtier.tiers.blockfile import BytesLike, CorruptBlockError
from kvtier.tiers.breaker import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_MAX_RESET_TIMEOUT_S,
    DEFAULT_RESET_TIMEOUT_S,
    BreakerState,
    CircuitBreaker,
)
from kvtier.tiers.namespace import check_namespace

logger = logging.getLogger(__name__)

DEFAULT_PASSWORD_ENV = REDIS_PASSWORD_ENV
SCHEMES = REDIS_URL_SCHEMES
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # includes authentication and busy-loading errors
    RedisTimeoutError,
    RedisClusterException,
    OSError,
    InvalidResponse,  # not a Redis protocol reply: a proxy or another service on the port
)
T = TypeVar("T")
_TIER = "redis tier"


class _Failed:
    """The result of a call that did not reach the server (or was refused)."""


class _ClosedUnderCall(Exception):
    """A call failed because ``RedisTier.close()`` ran during it."""


FAILED = _Failed()


class RedisTier(Tier):
    """Blocks in Redis/Valkey (see the module docstring).

    Parameters:
        url: server URL (``redis_url``).
        namespace: from ``KVLayout(...).namespace(tenant_salt)``.
        password_env: environment variable holding the password when the URL
            has none (None: never read the environment).
        cluster: use the cluster client; None: when the scheme ends in ``+cluster``.
        ttl_s: expiry of every value (None: none; rely on ``maxmemory-policy``).
        socket_timeout_s / connect_timeout_s: per-operation limits.
        max_batch_keys / max_batch_bytes: one pipeline's keys and payload bytes;
            a call holds at most one batch of values in memory.
        max_block_bytes: largest payload accepted (``put`` raises beyond it).
        failure_threshold / reset_timeout_s / max_reset_timeout_s: the breaker.
        key_prefix: first part of every Redis key.
        client_options: further keyword arguments for redis-py's client
            (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
            ``ssl_cert_reqs``, ``max_connections``...). A call that finds
            ``max_connections`` connections in use is a miss (counted in
            ``rejected``, not a server failure): give at least one per
            concurrent caller (the cascade's ``io_threads``).
    """

    name = "redis"
    remote = True

    MAX_EXISTS_KEYS = 4096
    """Keys one ``contains`` pipeline asks about: EXISTS replies are integers,
    so a larger batch costs no memory worth bounding by ``max_batch_keys``,
    and a scheduler step's probes (every unknown key of every waiting
    request's prompt, which vLLM asks in one pass) take one round trip, not
    one per ``max_batch_keys``."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        password_env: str | None = DEFAULT_PASSWORD_ENV,
        cluster: bool | None = None,
        ttl_s: float | None = None,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        max_batch_keys: int = 32,
        max_batch_bytes: int = 64 << 20,
        max_block_bytes: int | None = None,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        reset_timeout_s: float = DEFAULT_RESET_TIMEOUT_S,
        max_reset_timeout_s: float = DEFAULT_MAX_RESET_TIMEOUT_S,
        key_prefix: str = "kvtier",
        enable_events: bool = False,
        max_events: int = DEFAULT_MAX_TIER_EVENTS,
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.safe_url, scheme = _checked_url(url)
        try:
            self.namespace = check_namespace(namespace)
        except (TypeError, ValueError) as exc:
            raise TierConfigError(f"redis tier: {exc}") from None
        if not isinstance(key_prefix, str) or not key_prefix or ":" in key_prefix:
            raise TierConfigError(f"key_prefix must be a non-empty str without ':', got "
                                  f"{key_prefix!r}")
        self.cluster = scheme.endswith("+cluster") if cluster is None else bool(cluster)
        self.ttl_ms = (None if ttl_s is None
                       else max(1, int(seconds_setting(_TIER, "ttl_s", ttl_s) * 1000)))
        self.socket_timeout_s = seconds_setting(_TIER, "socket_timeout_s", socket_timeout_s)
        self.connect_timeout_s = seconds_setting(_TIER, "connect_timeout_s", connect_timeout_s)
        self.max_batch_keys = _int_setting("max_batch_keys", max_batch_keys, 1)
        self.max_batch_bytes = _int_setting("max_batch_bytes", max_batch_bytes, 1)
        self.max_block_bytes = (
            None if max_block_bytes is None
            else _int_setting("max_block_bytes", max_block_bytes, 1)
        )
        self._prefix = f"{key_prefix}:{self.namespace}:".encode()
        self._ns = self.namespace.encode()
        # the scheme without "+cluster" (any case): redis-py's own URL schemes
        self._url = (url[:len(scheme) - len("+cluster")] + url[len(scheme):]
                     if scheme.endswith("+cluster") else url)
        self._options = _options_with_password(self._url, client_options, password_env)
        if _decodes_responses(self._url, self._options):
            raise TierConfigError("redis tier: decode_responses must stay off: blocks are "
                                  "bytes, and decoded replies could not be read back")
        if self.cluster:
            _check_cluster_options(self._url, self._options)
        self._secrets = _secret_values(self._url, self._options)
        self._last_failure = ""
        self._client_obj: Any = None
        self._warn = WarningLimiter(logger)
        self._client_lock = threading.Lock()
        self._counters = Counters("rejected", "corrupt_kept")
        self._events = TierEventLog(self.name, enable_events, max_events)
        self._breaker = CircuitBreaker(
            failure_threshold, reset_timeout_s, max_reset_timeout_s, on_change=self._on_breaker
        )
        self._closed = False
        self._scripts_allowed = True  # until the server refuses EVAL (an ACL user)
        self._bounds_lock = threading.Lock()
        self._bounds_checked = False  # the server's maxmemory looked at (once per tier)
        if not self.cluster:
            self._client()  # parses the URL now (no connection yet): bad URLs fail here

    # ------------------------------------------------------------------ client
    def _client(self) -> Any:
        """The client, built on first use; ValueError once the tier is closed
        (a call that passed its ``_check_open`` before ``close`` must not build
        a new client that nothing would ever close)."""
        if self._client_obj is not None:
            return self._client_obj
        with self._client_lock:
            self._check_open()
            if self._client_obj is not None:
                return self._client_obj
            kwargs: dict[str, Any] = {
                "socket_timeout": self.socket_timeout_s,
                "socket_connect_timeout": self.connect_timeout_s,
                "retry": Retry(NoBackoff(), 0),
                "health_check_interval": 0,
            }
            kwargs.update(self._options)
            try:
                if self.cluster:
                    from redis.cluster import RedisCluster

                    self._client_obj = RedisCluster.from_url(self._url, **kwargs)
                else:
                    client = redis.Redis.from_url(self._url, **kwargs)
                    _check_connection_options(client)
                    self._client_obj = client
            except (ValueError, TypeError, RedisError) as exc:
                raise TierConfigError(
                    f"redis_url {self.safe_url!r}: {self._describe(exc, with_type=False)}"
                ) from None
            client = self._client_obj
            if self._closed:  # closed while a cluster client connected: close() missed it
                self._client_obj = None
                with contextlib.suppress(Exception):
                    client.close()
                self._check_open()
            return client

    def _describe(self, exc: BaseException, with_type: bool = True) -> str:
        """``"Type: message"`` of ``exc`` with the URL redacted and any password
        replaced by ``***`` (redis-py's messages hold none, but logs must not rely
        on that)."""
        text = str(exc).replace(self._url, self.safe_url)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return f"{type(exc).__name__}: {text}" if with_type else text

    def _explain(self, exc: BaseException) -> str:
        """``_describe(exc)`` with what a TLS mismatch looks like: a plain
        server that ``rediss://`` talks TLS to never answers the handshake
        (a connect timeout), a TLS port sent plain commands drops the
        connection (a reset); neither message says TLS."""
        text = self._describe(exc)
        tls = self._url.lower().startswith("rediss")
        if tls and isinstance(exc, RedisTimeoutError) and "connecting" in str(exc):
            return text + (" (or the port does not speak TLS: a rediss:// client waits "
                           "for a TLS handshake that a plain server never answers)")
        if not tls and isinstance(exc, RedisConnectionError) and any(
                s in str(exc) for s in ("reset by peer", "closed by server", "Broken pipe")):
            return text + (" (or the port speaks TLS: its URL must start with rediss://, "
                           "a TLS port drops plain commands)")
        return text

    def _rkey(self, key: bytes) -> bytes:
        return self._prefix + key

    def _on_breaker(self, state: BreakerState) -> None:
        if state == "open":
            logger.warning(
                "kvtier redis tier %s: circuit breaker open after %d failures (last: %s); "
                "serving misses and dropping stores until a probe succeeds", self.safe_url,
                self._breaker.failure_threshold, self._last_failure,
            )
            self._events.emit("breaker_open", (), self.safe_url)
        else:
            logger.warning("kvtier redis tier %s: reachable again, breaker closed",
                           self.safe_url)
            self._events.emit("breaker_closed", (), self.safe_url)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"redis tier {self.safe_url} is closed")

    def _run(self, fn: Callable[[Any], T]) -> T | _Failed:
        """Run ``fn(client)`` through the breaker; FAILED if refused or it failed.

        A call that ``close()`` overtakes (its sockets shut under it, or the
        tier closed between two batches of one call) is FAILED too, and none
        of the server's failures: no breaker count, no error, no warning."""
        if self._closed:
            return FAILED
        permit = self._breaker.allow()
        if permit is None:
            self._counters.add("rejected")
            return FAILED
        try:
            result = self._call(fn)
        except _ClosedUnderCall:
            return FAILED
        except TierConfigError:
            self._breaker.record_success(permit)
            raise
        except MaxConnectionsError:
            # this client's own limit (a max_connections option), not the server:
            # a miss, and no failure of the server for the breaker to count
            self._breaker.record_no_verdict(permit)
            self._counters.add("rejected")
            self._warn.warning("kvtier redis tier %s: every pooled connection is in use "
                               "(max_connections); calls beyond it are misses", self.safe_url)
            return FAILED
        except _TRANSPORT_ERRORS as exc:
            self._last_failure = self._explain(exc)  # named when the breaker opens
            self._breaker.record_failure(permit)
            self._counters.add("errors")
            self._drop_idle_connections()
            logger.debug("kvtier redis tier %s: %s", self.safe_url, self._last_failure)
            return FAILED
        except RedisError as exc:
            self._breaker.record_success(permit)  # the server answered
            self._counters.add("errors")
            self._warn.warning("kvtier redis tier %s: %s", self.safe_url, self._describe(exc))
            return FAILED
        except BaseException:  # a caller's mistake (a bad key...): nothing about the server
            self._breaker.record_no_verdict(permit)
            raise
        self._breaker.record_success(permit)
        if not self._bounds_checked:
            self._check_server_bounds()
        return result

    def _check_server_bounds(self, replies: list[Mapping[str, Any]] | None = None) -> None:
        """Warn once, when the tier first reaches its server (or ``check()``
        runs), if the server would keep kvtier's blocks without bound (see
        ``unbounded_server_warning``). ``replies``: INFO memory read already
        (``_info_sections``); else it is read now (one round trip, once).
        Advisory: a refused or failed INFO (an ACL user without ``info``)
        gives no warning, and nothing here fails a call."""
        with self._bounds_lock:
            if self._bounds_checked:
                return
            self._bounds_checked = True
        try:
            if replies is None:
                replies = _info_sections(self._client().info("memory"))
            warnings = [w for w in map(unbounded_server_warning, replies) if w]
        except Exception:  # advisory: any failure (refused, closed, timed out) is no warning
            return
        if warnings:  # one warning, not one per cluster node
            logger.warning("kvtier redis tier %s: %s", self.safe_url, warnings[0])

    def _call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)``; what it raises once the tier is closed becomes
        :class:`_ClosedUnderCall`: redis-py, its connection shut from another
        thread, fails in any way (``ConnectionError``, ``AttributeError`` on
        its parser's dropped buffer)."""
        try:
            return fn(self._client())
        except Exception:
            if self._closed:
                raise _ClosedUnderCall from None
            raise

    def _drop_idle_connections(self) -> None:
        """After a transport failure, pooled connections are likely dead too: close
        them, so the next call (the breaker's probe) connects afresh."""
        client = self._client_obj
        if client is None:
            return
        with contextlib.suppress(Exception):
            if self.cluster:
                client.disconnect_connection_pools()
            else:
                client.connection_pool.disconnect(inuse_connections=False)

    @property
    def available(self) -> bool:
        return self._breaker.ready()

    @property
    def serving(self) -> bool:
        return self._breaker.state == "closed"

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    # ------------------------------------------------------------------ reads
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        keys = check_batch(keys)
        out: list[bool] = []
        for start in range(0, len(keys), self.MAX_EXISTS_KEYS):
            chunk = keys[start : start + self.MAX_EXISTS_KEYS]

            def exists(client: Any, chunk: list[bytes] = chunk) -> list[Any]:
                return self._pipelined(client, chunk,
                                       lambda pipe, i: pipe.exists(self._rkey(chunk[i])))

            res = self._run(exists)
            if isinstance(res, _Failed):
                out.extend([False] * len(chunk))
            else:
                out.extend(isinstance(r, int) and r > 0 for r in res)
        return out

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        """Read each key's payload into its buffer: its size, which is the
        buffer's, or None (a miss; a value of another length is a bad value,
        see the module docstring)."""
        self._check_open()
        keys = check_batch(keys)
        check_buffers(keys, buffers)
        views: list[memoryview | None] = [
            blockfile.byte_view(b, writable=True) for b in buffers
        ]
        return [n for n, _ in self._get(keys, views)]

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        self._check_open()
        keys = check_batch(keys)
        return [v for _, v in self._get(keys, [None] * len(keys))]

    def _get(
        self, keys: list[bytes], dests: list[memoryview | None]
    ) -> list[tuple[int | None, memoryview | None]]:
        out: list[tuple[int | None, memoryview | None]] = []
        expected = [d.nbytes if d is not None else self.max_block_bytes or 0 for d in dests]
        for start, end in self._batches(expected):
            chunk = keys[start:end]

            def fetch(client: Any, chunk: list[bytes] = chunk) -> list[Any]:
                return self._pipelined(client, chunk,
                                       lambda pipe, j: pipe.get(self._rkey(chunk[j])))

            values = self._run(fetch)
            if isinstance(values, _Failed):
                self._counters.add("misses", len(chunk))
                out.extend([(None, None)] * len(chunk))
                continue
            corrupt: list[tuple[bytes, str, bytes]] = []
            hits = 0
            for i, (key, value) in enumerate(zip(chunk, values, strict=True)):
                result = self._accept(key, value, dests[start + i], corrupt)
                hits += result[0] is not None
                out.append(result)
            del values
            self._counters.add("hits", hits)
            self._counters.add("misses", len(chunk) - hits)
            if corrupt:
                self._drop_corrupt(corrupt)
        return out

    def _accept(
        self, key: bytes, value: Any, dest: memoryview | None,
        corrupt: list[tuple[bytes, str, bytes]],
    ) -> tuple[int | None, memoryview | None]:
        if value is None:
            return None, None
        if isinstance(value, BaseException):
            self._counters.add("errors")
            self._warn.warning("kvtier redis tier %s: GET failed: %s", self.safe_url,
                               self._describe(value))
            return None, None
        try:
            payload = blockfile.decode(value, self._ns, key)
            n = payload.nbytes
            if dest is None:
                return n, payload
            if n != dest.nbytes:
                # A buffer is a CPU slot, and every block of a namespace fills
                # one: a value of another size is no block this reader can use
                # (the cascade would refuse it after the tier counted a hit).
                raise CorruptBlockError("wrong length", f"{n} bytes for a {dest.nbytes}-byte "
                                                        "buffer")
        except CorruptBlockError as exc:
            corrupt.append((key, exc.reason, value))
            return None, None
        dest[:n] = payload
        return n, dest[:n]

    def _drop_corrupt(self, corrupt: list[tuple[bytes, str, bytes]]) -> None:
        """Delete each corrupt value unless the key holds another value by now (a
        fresh copy another engine stored since this one read it). A user the
        server does not let run scripts (an ACL with only kvtier's plain
        commands) deletes unconditionally. Counts and reports each value by
        what became of it (``_removal``)."""
        keys = [k for k, _, _ in corrupt]
        replies = self._run(lambda client: self._delete_corrupt(client, corrupt))
        outcomes = ([None] * len(keys) if isinstance(replies, _Failed)
                    else [_removal(r) for r in replies])
        for (key, reason, _), outcome in zip(corrupt, outcomes, strict=True):
            if outcome is None:
                self._counters.add("corrupt_kept")
                self._warn.warning("kvtier redis tier %s: corrupt value of key %s (%s) not "
                                   "removed (the delete was refused or failed); it stays a "
                                   "miss", self.safe_url, key.hex(), reason)
                continue
            self._counters.add("corrupt")
            if outcome == "removed":  # else the key holds a fresh copy: nothing left
                self._events.emit("corrupt", [key], reason)
            self._warn.warning("kvtier redis tier %s: removed corrupt value of key %s: %s",
                               self.safe_url, key.hex(), reason)

    def _delete_corrupt(self, client: Any, corrupt: list[tuple[bytes, str, bytes]]) -> list[Any]:
        """One reply per corrupt value, in order: the delete script's (1
        deleted, 0 gone, -1 replaced by another value) or DEL's (1, 0); an
        error instance where neither could run (counted in ``errors``)."""
        keys = [k for k, _, _ in corrupt]
        replies: list[Any] = [None] * len(keys)  # None: not run
        if self._scripts_allowed:
            replies = self._pipelined(client, keys, lambda pipe, i: pipe.eval(
                _DELETE_IF_UNCHANGED, 1, self._rkey(keys[i]), corrupt[i][2]))
            if any(_refused_script(r) for r in replies):
                self._scripts_allowed = False
        # DEL where the script did not run (not allowed, refused, or failed)
        left = [i for i, r in enumerate(replies) if r is None or isinstance(r, BaseException)]
        if left:
            deleted = self._pipelined(client, [keys[i] for i in left],
                                      lambda pipe, j: pipe.delete(self._rkey(keys[left[j]])))
            for i, reply in zip(left, deleted, strict=True):
                replies[i] = reply
        self._counters.add("errors", sum(isinstance(r, BaseException) for r in replies))
        return replies

    def _batches(self, sizes: list[int]) -> Iterator[tuple[int, int]]:
        """``(start, end)`` of consecutive pipelines over blocks of ``sizes``
        payload bytes: at most ``max_batch_keys`` keys and ``max_batch_bytes``
        bytes each (a larger block goes alone)."""
        start = 0
        while start < len(sizes):
            end, size = start, 0
            while end < len(sizes) and end - start < self.max_batch_keys and (
                end == start or size + sizes[end] <= self.max_batch_bytes
            ):
                size += sizes[end]
                end += 1
            yield start, end
            start = end

    # ------------------------------------------------------------------ writes
    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        """Store blocks (SET, or SET PX ``ttl_s``), one pipeline per batch."""
        self._check_open()
        keys, views = check_items(items)
        if self.max_block_bytes is not None:
            for view in views:
                if view.nbytes > self.max_block_bytes:
                    raise ValueError(
                        f"payload of {view.nbytes} bytes exceeds the redis tier's "
                        f"max_block_bytes={self.max_block_bytes}"
                    )
        out: list[bool] = []
        stored: list[bytes] = []
        for start, end in self._batches([view.nbytes for view in views]):
            chunk = keys[start:end]
            results = self._set_batch(chunk, views[start:end])
            for key, ok in zip(chunk, results, strict=True):
                out.append(ok)
                if ok:
                    stored.append(key)
        ok_count = len(stored)
        self._counters.add("stores", ok_count)
        self._counters.add("dropped_stores", len(keys) - ok_count)
        self._events.emit("stored", stored)
        return out

    def _set_batch(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        if not self._breaker.ready():
            self._counters.add("rejected")
            return [False] * len(keys)
        res = self._run(lambda client: self._store(client, keys, views))
        if isinstance(res, _Failed):
            return [False] * len(keys)
        out = []
        for r in res:
            if isinstance(r, BaseException):
                self._counters.add("errors")
                if not isinstance(r, ResponseError) or "OOM" not in str(r):
                    self._warn.warning("kvtier redis tier %s: SET failed: %s",
                                       self.safe_url, self._describe(r))
                out.append(False)
            else:
                out.append(bool(r))
        return out

    def _store(self, client: Any, keys: list[bytes], views: list[memoryview]) -> list[Any]:
        """SET each value; replies (or ResponseError instances) in key order."""
        if self.cluster:
            return self._pipelined(client, keys, lambda pipe, i: pipe.set(
                self._rkey(keys[i]), blockfile.encode(self._ns, keys[i], views[i]),
                px=self.ttl_ms))
        # One connection, one pipelined send: the header and the caller's buffer go
        # to the socket as they are (no concatenated copy of the payload).
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            chunks: list[Any] = []
            tail = b""
            for key, view in zip(keys, views, strict=True):
                header = blockfile.pack_header(self._ns, key, view)
                chunks.append(tail + self._set_prefix(key, len(header) + view.nbytes) + header)
                chunks.append(view)
                tail = self._set_suffix
            chunks.append(tail)
            conn.send_packed_command(chunks)
            replies: list[Any] = []
            for _ in keys:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:  # e.g. OOM under maxmemory noeviction
                    replies.append(exc)
            return replies
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _pipelined(self, client: Any, keys: list[bytes],
                   add: Callable[[Any, int], Any]) -> list[Any]:
        """One command per key (``add(pipe, i)`` for ``keys[i]``), pipelined;
        replies (or error instances) in key order.

        A cluster gets one plain pipeline per node, sent in turn, so a node
        that does not answer raises after one socket timeout (a failure the
        breaker counts). redis-py's cluster pipeline instead retried each
        command that timed out on its own: one hung node cost a timeout per
        key, and the call returned no error. A moved slot (``MOVED``/``ASK``
        replies, counted as errors) refreshes the slot map for the next call.
        """
        if not self.cluster:
            pipe = client.pipeline(transaction=False)
            for i in range(len(keys)):
                add(pipe, i)
            return list(pipe.execute(raise_on_error=False))
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, key in enumerate(keys):
            node = client.get_node_from_key(self._rkey(key))
            by_node.setdefault(node.name, (node, []))[1].append(i)
        out: list[Any] = [None] * len(keys)
        moved = False
        for node, indices in by_node.values():
            pipe = client.get_redis_connection(node).pipeline(transaction=False)
            for i in indices:
                add(pipe, i)
            for i, reply in zip(indices, pipe.execute(raise_on_error=False), strict=True):
                out[i] = reply
                moved = moved or (isinstance(reply, ResponseError)
                                  and str(reply).startswith(("MOVED", "ASK")))
        if moved:
            client.nodes_manager.initialize()
        return out

    def _set_prefix(self, key: bytes, value_len: int) -> bytes:
        rkey = self._rkey(key)
        nargs = 3 if self.ttl_ms is None else 5
        return b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (
            nargs, len(rkey), rkey, value_len,
        )

    @property
    def _set_suffix(self) -> bytes:
        if self.ttl_ms is None:
            return b"\r\n"
        ms = str(self.ttl_ms).encode()
        return b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ms), ms)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        keys = check_batch(keys)

        def delete(client: Any) -> list[Any]:
            return self._pipelined(client, keys,
                                   lambda pipe, i: pipe.delete(self._rkey(keys[i])))

        res = self._run(delete) if keys else []
        if isinstance(res, _Failed):
            return 0
        removed = [k for k, r in zip(keys, res, strict=True) if isinstance(r, int) and r > 0]
        self._events.emit("removed", removed, "deleted")
        return len(removed)

    # ------------------------------------------------------------------ status
    def check(self) -> dict[str, Any]:
        """PING the server now (bypassing the breaker) and describe it.

        Returns ``redis_version``, ``maxmemory`` and ``maxmemory_policy`` where the
        server tells them (and warns, once per tier, of a server without bound:
        ``unbounded_server_warning``). Raises :class:`TierUnavailableError`
        (URL redacted).
        """
        try:
            client = self._client()
            client.ping()
        except (RedisError, RedisClusterException, OSError) as exc:
            raise TierUnavailableError(
                f"redis tier {self.safe_url}: {self._explain(exc)}"
            ) from None
        info: dict[str, Any] = {}
        try:
            replies = _info_sections(client.info("memory"))
            info["maxmemory"] = int(replies[0].get("maxmemory", 0))
            info["maxmemory_policy"] = replies[0].get("maxmemory_policy", "")
            self._check_server_bounds(replies)
            info["redis_version"] = _info_sections(client.info("server"))[0].get(
                "redis_version", "")
        except (RedisError, RedisClusterException, OSError, TypeError, ValueError):
            pass  # a server that will not say (an ACL user without info)
        return info

    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(self._counters.snapshot())
        out["breaker_state"] = self._breaker.state
        out["breaker_opens"] = self._breaker.opens
        out["events_dropped"] = self._events.dropped
        return out

    def take_events(self) -> list[TierEvent]:
        return self._events.take()

    def debug_state(self) -> dict[str, int]:
        """Pending events (at most ``max_events``); no per-block state is kept
        in process (the server holds the blocks)."""
        return {"events": len(self._events)}

    def close(self) -> None:
        """Close the client's connections; calls running now (an I/O thread left
        in a hung server) end at once as misses / dropped stores, later ones
        raise ValueError. Never waits for the server."""
        self._closed = True  # before taking the client: see _client
        client, self._client_obj = self._client_obj, None
        if client is not None:
            with contextlib.suppress(RedisError, OSError):
                client.close()

    def __repr__(self) -> str:
        return f"RedisTier({self.safe_url!r}, namespace={self.namespace!r})"


def _info_sections(raw: Any) -> list[Mapping[str, Any]]:
    """An INFO section's replies: one, or a cluster client's one per node."""
    if isinstance(raw, Mapping) and raw and all(isinstance(v, Mapping) for v in raw.values()):
        return list(raw.values())
    if not isinstance(raw, Mapping):
        raise TypeError(f"INFO answered {type(raw).__name__}, not a mapping")
    return [raw]


def unbounded_server_warning(memory: Mapping[str, Any]) -> str | None:
    """What is wrong with a server whose INFO memory is ``memory``, for
    kvtier's blocks, or None: without ``maxmemory`` (Debian's default) the
    blocks grow the server until the host runs out of memory; under
    ``noeviction`` a full server refuses every later store and keeps its
    oldest blocks for ever. Neither fails the tier, so only a warning says so."""
    maxmemory = int(memory.get("maxmemory", 0) or 0)
    policy = str(memory.get("maxmemory_policy", ""))
    fix = ("set the server's maxmemory and maxmemory-policy allkeys-lru (volatile-lru "
           "when redis_ttl_s is set) so that it evicts the least recently used blocks")
    if maxmemory == 0:
        return (f"the server has no maxmemory (policy {policy or 'unknown'}): kvtier's "
                f"blocks will grow it without bound; {fix}")
    if policy == "noeviction":
        return (f"the server's maxmemory-policy is noeviction: once its maxmemory "
                f"({maxmemory} bytes) is full it refuses kvtier's stores and never frees "
                f"old blocks; {fix}")
    return None


def _secret_values(url: str, options: Mapping[str, Any]) -> tuple[str, ...]:
    """The passwords of ``url`` (as written and decoded) and of ``options``."""
    found: list[str] = []
    with contextlib.suppress(ValueError):
        raw = urlsplit(url).password
        if raw:
            found += [raw, unquote(raw)]
        found += [v for k, v in parse_qsl(urlsplit(url).query) if k.lower() in HIDDEN_QUERY_KEYS
                  and v]
    for value in (options.get("password"), options.get("ssl_password")):
        if isinstance(value, str) and value:
            found.append(value)
    return tuple(sorted(set(found), key=len, reverse=True))  # longest first


def _check_connection_options(client: Any) -> None:
    """Build (without connecting) one connection from ``client``'s options, so
    that a misspelt or invalid option (``ssl_ca_cert=``, ``ssl_cert_reqs=requird``)
    fails now, as a config error, not on every call."""
    pool = client.connection_pool
    pool.connection_class(**pool.connection_kwargs)


_DELETE_IF_UNCHANGED = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
    "if v then return -1 end "
    "return 0")
"""Deletes KEYS[1] only while it still holds ARGV[1] (the corrupt value read):
1 deleted, 0 the key is gone, -1 it holds another value (a fresh copy)."""


def _removal(reply: object) -> str | None:
    """What became of a corrupt value, from its delete's reply: ``"removed"``
    (deleted here, or the key is gone), ``"replaced"`` (the key holds another
    value), or None (not removed: the delete was refused or failed)."""
    if isinstance(reply, BaseException) or not isinstance(reply, int):
        return None
    return "replaced" if reply < 0 else "removed"


def _refused_script(reply: object) -> bool:
    """Whether ``reply`` is the server refusing to run a script for this user."""
    if isinstance(reply, NoPermissionError):  # the server's NOPERM reply
        return True
    return isinstance(reply, ResponseError) and "unknown command" in str(reply).lower()


def _check_cluster_options(url: str, options: Mapping[str, Any]) -> None:
    """Refuse options (``client_options`` or the URL's query) that redis-py's
    cluster client would drop without a word: it keeps only the connection
    options it knows, so a misspelt ``ssl_ca_certs`` or timeout would leave
    its default in force. (The plain client fails on them when it builds a
    connection: ``_check_connection_options``.)"""
    from redis.cluster import KWARGS_DISABLED_KEYS, REDIS_ALLOWED_KEYS, RedisCluster

    cluster_own = set(inspect.signature(RedisCluster.__init__).parameters) - {"self", "kwargs"}
    per_connection = set(REDIS_ALLOWED_KEYS) - set(KWARGS_DISABLED_KEYS)
    # the URL's query reaches only the connections (the cluster's own settings
    # in it, such as read_from_replicas, are dropped as well)
    queried = {k for k, _ in parse_qsl(urlsplit(url).query)}
    unknown = sorted((set(options) - per_connection - cluster_own) | (queried - per_connection))
    allowed = per_connection | cluster_own
    if unknown:
        raise TierConfigError(
            f"redis tier: redis-py's cluster client would ignore the option(s) {unknown}; "
            f"it takes {sorted(allowed)}")


def _decodes_responses(url: str, options: Mapping[str, Any]) -> bool:
    """Whether the client would decode replies to str (``decode_responses``
    in ``options`` or in the URL's query, true as redis-py reads it)."""
    values = [str(v) for k, v in parse_qsl(urlsplit(url).query) if k == "decode_responses"]
    if "decode_responses" in options:
        values.append(str(options["decode_responses"]))
    return any(v.strip().upper() not in ("", "0", "F", "FALSE", "N", "NO", "NONE")
               for v in values)


def _int_setting(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TierConfigError(f"redis tier: {name} must be an int >= {low}, got {value!r}")
    return value



def _checked_url(url: object) -> tuple[str, str]:
    """(``url`` with its password hidden, its scheme); ``TierConfigError`` when
    it cannot name a Redis server."""
    if not isinstance(url, str) or not url:
        raise TierConfigError(f"redis_url must be a non-empty str, got {type(url).__name__}")
    safe = redact_url(url)
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise TierConfigError(f"redis_url {safe!r}: scheme must be one of {list(SCHEMES)}")
    if misplaced_at(url):
        raise TierConfigError(f"redis_url {safe!r}: {MISPLACED_AT_HINT}")
    try:
        urlsplit(url).port  # noqa: B018  (parses the host and port: raises on bad ones)
    except ValueError as exc:
        # neither the URL nor a port that quotes a piece of it: it may hold a password
        reason = "Port is not a number" if "'" in str(exc) else str(exc)
        raise TierConfigError(f"redis_url cannot be parsed: {reason}") from None
    database = urlsplit(url).path.strip("/")
    if not scheme.startswith("unix") and database and not database.isdigit():
        # redis-py would use database 0 without a word
        raise TierConfigError(f"redis_url {safe!r}: the database after the host must be a "
                              f"number, got {database!r}")
    return safe, scheme


def check_redis_url(url: str) -> None:
    """``TierConfigError`` when a Redis tier could not be built on ``url``: as
    :class:`RedisTier` reads it and its options, without connecting (a check
    before a server starts)."""
    RedisTier(url, "kvtier-url-check").close()


def _options_with_password(url: str, client_options: Mapping[str, Any] | None,
                           password_env: str | None) -> dict[str, Any]:
    """The client's options: ``client_options``, plus the password from the
    environment variable ``password_env`` when neither the URL nor the options
    carry one."""
    options: dict[str, Any] = dict(client_options or {})
    if password_env is not None and urlsplit(url).password is None:
        secret = os.environ.get(password_env)
        if secret and "password" not in options:
            options["password"] = secret
    return options
