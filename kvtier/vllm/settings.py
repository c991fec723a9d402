"""kvtier's keys in vLLM's ``kv_connector_extra_config``, validated at start-up.

Imports nothing from vLLM, so the rules are testable (and documented) without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.argtypes import is_positive_seconds, parse_byte_size
from kvtier.errors import KVTierError
from kvtier.history import DEFAULT_EVICTION_HISTORY_SIZE
from kvtier.leases import DEFAULT_LEASE_TIMEOUT_S, DEFAULT_MAX_LEASES_PER_REQUEST
from kvtier.policies import policy_class
from kvtier.replay.recorder import DEFAULT_MAX_REQUESTS
from kvtier.secrets import (
    ENV_PREFIX,
    MISPLACED_AT_HINT,
    REDIS_URL_SCHEMES,
    misplaced_at,
    redact_url,
)
from kvtier.slots.jobs import CUDA_COPY_MODES, CudaCopy
from kvtier.tiers.cascade import DEFAULT_PROMOTION_TIMEOUT_S
from kvtier.tiers.disk_lookups import LOOKUP_MODES
from kvtier.tiers.lower_tier import WRITE_POLICIES

_BYTE_COUNT = 'a byte count, or a size such as "8GiB"'

VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "offload_prompt_only",
        "self_describing_kv_events",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
    }
)
"""Keys of the same dict that vLLM itself reads; passed through untouched."""

BYTE_KEYS = ("cpu_bytes_to_use", "disk_bytes")
"""Settings that are byte counts: an int, or text with the size suffixes the
command-line flags take (``"10GiB"``, ``"8G"``: ``kvtier.argtypes.parse_byte_size``)."""

SECRET_KEYS = frozenset({"redis_url", "tenant_salt"})
"""Keys whose values may hold a secret (``kvtier.secrets``): error messages name
their type, never their value, and ``repr`` redacts the URL and omits the salt."""


class ConfigError(KVTierError, ValueError):
    """A ``kv_connector_extra_config`` value kvtier cannot use; names the key."""


def one_block_per_slot_error(given: str) -> ConfigError:
    """The refusal of a ``block_size``/``blocks_per_chunk`` that makes vLLM move
    several engine blocks as one chunk (``given`` says which, e.g.
    ``"blocks_per_chunk=2"``): the engine's, and ``kvtier serve``'s before it."""
    return ConfigError(f"KVTierSpec stores one engine block per slot; {given} is not "
                       "supported: leave both 'block_size' and 'blocks_per_chunk' unset")


@dataclass(frozen=True)
class KVTierSettings:
    """kvtier's configuration of one engine (see the README's config table).

    ``cpu_bytes_to_use`` is required: the CPU slot region's size in bytes.
    ``from_extra_config`` reads the byte settings (``BYTE_KEYS``) from ints or
    size strings, and expands a leading ``~`` in ``disk_path``.
    """

    cpu_bytes_to_use: int
    eviction_policy: str = "default"
    store_threshold: int = 1
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    eviction_history_size: int = DEFAULT_EVICTION_HISTORY_SIZE
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    max_leases_per_request: int = DEFAULT_MAX_LEASES_PER_REQUEST
    max_leased_blocks: int | None = None
    """Blocks leased by all requests together; None: half the CPU tier."""
    disk_path: str | None = None
    """Directory of the disk tier (shared by engines of one host; a leading ``~``
    expanded); None: no disk tier."""
    disk_bytes: int | None = None
    """Bytes of block files the disk tier may keep; required with ``disk_path``."""
    disk_write_policy: str = "store"
    """When the disk tier gets a block: "store" (written through when stored in
    CPU) or "evict" (when the CPU tier evicts it)."""
    disk_store_threshold: int = 1
    """Requests that must use a block (hit it or offer it) before it is written
    to disk; 2 spares the SSD the one-off prompts."""
    disk_lookups: str = "auto"
    """Where the scheduler looks for blocks other engines wrote to ``disk_path``:
    "thread" (waits at most ``DEFAULT_LOOKUP_TIMEOUT_S``; a hung network file
    system costs that once, then misses), "inline", or "auto": "thread" on a
    network or FUSE file system (``kvtier.tiers.disk_lookups``)."""
    redis_url: str | None = None
    """Redis/Valkey URL of the shared tier; None: no Redis tier."""
    redis_write_policy: str = "store"
    """As ``disk_write_policy``, for the Redis tier."""
    redis_store_threshold: int = 1
    """As ``disk_store_threshold``, for the Redis tier."""
    redis_async_lookups: bool = True
    """Ask Redis which blocks it holds in batches on an I/O thread (lookups
    answer RETRY meanwhile; a new request waits a scheduler step) rather than
    one round trip per request on the scheduler thread."""
    promotion_timeout_s: float = DEFAULT_PROMOTION_TIMEOUT_S
    """Seconds a request waits for a block to come up from disk or Redis before
    computing it instead: the most a slow or stuck tier adds to a TTFT."""
    redis_ttl_s: float | None = None
    """Expiry of every Redis value in seconds; None: none (the server's
    ``maxmemory`` and ``maxmemory-policy`` bound the tier)."""
    tenant_salt: str | None = field(default=None, repr=False)
    """Separates tenants sharing the disk/Redis tiers (keyed into the namespace).
    ``"env:NAME"`` reads it from the environment variable NAME, so that no
    command line or log holds it (``kvtier serve`` does this)."""
    model_identity: str | None = None
    """An identity of the weights the operator vouches for (e.g. the
    checkpoint's digest), used instead of kvtier's fingerprint of the weights
    files; needed when the weights are not local files."""
    trace_path: str | None = None
    """A new file to record the engine's requests in, as a Mooncake-format
    trace for ``kvtier replay`` (``kvtier.replay.recorder``; ``{pid}`` is
    replaced by the process id, a leading ``~`` expanded); None: none."""
    trace_max_requests: int = DEFAULT_MAX_REQUESTS
    """Requests recorded in ``trace_path``; recording stops after them."""
    cuda_copy: CudaCopy = "auto"
    """How blocks cross between a CUDA engine's KV cache and the CPU slots:
    "memcpy" (copy engines, no SM time), "mapped" (one kernel per batch: fast
    for scattered small blocks, takes SM time) or "auto" (``kvtier.slots.cuda``)."""

    def __repr__(self) -> str:
        """The fields as a dataclass shows them, but the Redis URL's password
        redacted and the tenant salt left out (``SECRET_KEYS``)."""
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "redis_url" and isinstance(value, str):
                value = redact_url(value)
            if f.repr:
                shown.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    @classmethod
    def accepted_keys(cls) -> list[str]:
        """kvtier's own keys, in declaration order."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> KVTierSettings:
        """Validate ``extra``; raise ``ConfigError`` naming the first bad key."""
        if not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a dict, got "
                              f"{type(extra).__name__}")
        own = cls.accepted_keys()
        unknown = sorted(set(extra) - set(own) - VLLM_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for KVTierSpec; "
                f"kvtier accepts {own} (plus vLLM's own {sorted(VLLM_KEYS)})"
            )
        if "cpu_bytes_to_use" not in extra:
            raise ConfigError(
                "kv_connector_extra_config needs 'cpu_bytes_to_use': the bytes of CPU "
                "memory kvtier may use for offloaded KV blocks, e.g. 8000000000"
            )
        values = _normalized({k: extra[k] for k in own if k in extra})
        for prefix, owner in (("disk_", "disk_path"), ("redis_", "redis_url"),
                              ("trace_", "trace_path")):
            orphans = sorted(k for k in values if k.startswith(prefix) and k != owner)
            if orphans and values.get(owner) is None and not (
                    prefix == "disk_" and orphans == ["disk_bytes"]):
                raise ConfigError(f"{orphans} set but {owner} is not: they configure that tier")
        settings = cls(**values)
        settings._validate()
        return settings._with_secrets()

    def _with_secrets(self) -> KVTierSettings:
        """These settings with ``tenant_salt`` read from the environment when it
        names a variable (``env:NAME``)."""
        salt = self.tenant_salt
        if salt is None or not salt.startswith(ENV_PREFIX):
            return self
        name = salt.removeprefix(ENV_PREFIX)
        value = os.environ.get(name) if name else None
        if not value:
            raise ConfigError(f"tenant_salt names the environment variable {name!r}, "
                              "which is not set (or empty)")
        return replace(self, tenant_salt=value)

    def _validate(self) -> None:
        _int_at_least("cpu_bytes_to_use", self.cpu_bytes_to_use, 1, _BYTE_COUNT)
        _int_at_least("store_threshold", self.store_threshold, 1,
                      "1 stores every block, 2 only blocks offered twice")
        _int_at_least("max_tracker_size", self.max_tracker_size, 1, "entries")
        _int_at_least("eviction_history_size", self.eviction_history_size, 0, "keys")
        _int_at_least("max_leases_per_request", self.max_leases_per_request, 1, "keys")
        if self.max_leased_blocks is not None:
            _int_at_least("max_leased_blocks", self.max_leased_blocks, 1, "blocks")
        for key in ("lease_timeout_s", "promotion_timeout_s"):
            timeout = getattr(self, key)
            if not is_positive_seconds(timeout):
                raise ConfigError(f"{key} must be a finite number of seconds > 0, "
                                  f"got {timeout!r}")
        for key in ("disk_path", "redis_url", "tenant_salt", "model_identity", "trace_path"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{key} must be a non-empty str (or unset), got "
                                  f"{_shown(key, value)}")
        if self.redis_url is not None:
            if misplaced_at(self.redis_url):
                raise ConfigError(f"redis_url {redact_url(self.redis_url)!r}: "
                                  f"{MISPLACED_AT_HINT}")
            scheme = self.redis_url.partition("://")[0].lower()
            if "://" not in self.redis_url or scheme not in REDIS_URL_SCHEMES:
                raise ConfigError(f"redis_url {redact_url(self.redis_url)!r}: the scheme "
                                  f"must be one of {list(REDIS_URL_SCHEMES)}")
        self._validate_disk()
        _int_at_least("trace_max_requests", self.trace_max_requests, 1, "requests recorded")
        for tier in ("disk", "redis"):
            policy = getattr(self, f"{tier}_write_policy")
            if policy not in WRITE_POLICIES:
                raise ConfigError(
                    f"{tier}_write_policy must be one of {list(WRITE_POLICIES)} (write when "
                    f"stored in CPU, or when evicted from CPU), got {policy!r}"
                )
            _int_at_least(f"{tier}_store_threshold", getattr(self, f"{tier}_store_threshold"),
                          1, "requests using a block before the tier gets it")
        if not isinstance(self.redis_async_lookups, bool):
            raise ConfigError(f"redis_async_lookups must be true or false, "
                              f"got {self.redis_async_lookups!r}")
        ttl = self.redis_ttl_s
        if ttl is not None and not is_positive_seconds(ttl):
            raise ConfigError(f"redis_ttl_s must be a finite number of seconds > 0 (or "
                              f"unset), got {ttl!r}")
        if self.cuda_copy not in CUDA_COPY_MODES:
            raise ConfigError(f"cuda_copy must be one of {list(CUDA_COPY_MODES)}, "
                              f"got {self.cuda_copy!r}")
        if not isinstance(self.eviction_policy, str):
            raise ConfigError(f"eviction_policy must be a str, got {self.eviction_policy!r}")
        try:
            policy_class(self.eviction_policy)
        except ValueError as exc:
            raise ConfigError(f"eviction_policy: {exc}") from None

    def _validate_disk(self) -> None:
        if self.disk_path is not None and self.disk_bytes is None:
            raise ConfigError("disk_bytes is required with disk_path: the disk tier's size")
        if self.disk_bytes is not None:
            if self.disk_path is None:
                raise ConfigError("disk_bytes is set but disk_path is not")
            _int_at_least("disk_bytes", self.disk_bytes, 1, _BYTE_COUNT)
        if self.disk_lookups not in LOOKUP_MODES:
            raise ConfigError(f"disk_lookups must be one of {list(LOOKUP_MODES)}, "
                              f"got {self.disk_lookups!r}")


def _normalized(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the byte-size settings given as text parsed to ints and
    ``~`` expanded in ``disk_path`` (a shell leaves ``--disk-path=~/kv`` as
    written: the tier would make a directory named ``~``); the checks of their
    types and ranges are ``_validate``'s."""
    out = dict(values)
    for key in BYTE_KEYS:
        value = out.get(key)
        if isinstance(value, str):
            try:
                out[key] = parse_byte_size(value)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None
    for key in ("disk_path", "trace_path"):
        path = out.get(key)
        if isinstance(path, str) and path.startswith("~"):
            out[key] = expand_home(path, key)
    return out


def expand_home(path: str, key: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded; ``ConfigError``
    (naming ``key``) when it cannot be (no home directory known): a
    directory literally named ``~`` is never what was meant."""
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
        raise ConfigError(f"{key} {path!r}: cannot expand its '~' (no such user, or "
                          "HOME is not set): give the full path")
    return expanded


def _shown(key: str, value: object) -> str:
    """``value`` as an error message may show it: the type of a secret key's."""
    if key in SECRET_KEYS:
        return f"a value of type {type(value).__name__}" if value != "" else "an empty str"
    return repr(value)


def _int_at_least(key: str, value: object, low: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key} must be an int >= {low} ({meaning}), got {value!r}")
