"""Namespaces of the shared tiers (DESIGN.md §2).

Blocks in the disk and Redis tiers live under a namespace: a short hex string
derived from everything that makes a KV block's bytes mean something (model,
KV dtype, block size, layer/head geometry, parallel rank) and an optional
tenant salt. Two engines share blocks exactly when their namespaces are equal;
a block written under one namespace is never served to another (the namespace
is part of every value's checksummed header, see ``blockfile``).

The salt is mixed in as a keyed hash, so the namespace reveals nothing about
it; it is never logged (``KVLayout``'s repr does not hold it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from kvtier.tiers.blockfile import MAX_NAMESPACE_BYTES

NAMESPACE_HEX_CHARS = 16
"""Length of a derived namespace: 64 bits of BLAKE2b."""

_PERSON = b"kvtier-ns-v1"
_VALID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def check_namespace(namespace: object) -> str:
    """Return ``namespace`` if usable as a directory name and key prefix, else raise.

    Allowed: 1..64 characters from ``[A-Za-z0-9_.-]``, not starting with a dot.
    """
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
    if not 1 <= len(namespace) <= MAX_NAMESPACE_BYTES or not _VALID.fullmatch(namespace):
        raise ValueError(
            f"namespace must be 1..{MAX_NAMESPACE_BYTES} characters of [A-Za-z0-9_.-] "
            f"not starting with '.', got {namespace!r:.80} (derive one with "
            "kvtier.tiers.KVLayout(...).namespace())"
        )
    return namespace


def _positive(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class KVLayout:
    """What a block's bytes depend on; ``namespace()`` fingerprints it.

    ``extra`` holds any further layout facts (e.g. ``{"kv_layout": "NHD"}``,
    a cache dtype scale mode); its items enter the fingerprint sorted.
    """

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    extra: Mapping[str, str | int | float | bool] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("model", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size", "pp_size"):
            _positive(name, getattr(self, name))
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            _positive(rank, getattr(self, rank), 0)
            if getattr(self, rank) >= getattr(self, size):
                raise ValueError(
                    f"{rank} must be < {size}, got {getattr(self, rank)} >= {getattr(self, size)}"
                )
        if not isinstance(self.extra, Mapping) or not all(
            isinstance(k, str) for k in self.extra
        ):
            raise ValueError("extra must be a mapping with str keys")

    def fingerprint(self) -> bytes:
        """Canonical bytes of the layout (sorted JSON)."""
        fields = asdict(self)
        fields["extra"] = dict(sorted(self.extra.items()))
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def namespace(self, tenant_salt: str | bytes | None = None) -> str:
        """The 16-hex-character namespace of this layout (and tenant, when salted)."""
        return namespace_of(self.fingerprint(), tenant_salt)


def namespace_of(fingerprint: bytes, tenant_salt: str | bytes | None = None) -> str:
    """Namespace of raw fingerprint bytes; ``tenant_salt`` keys the hash."""
    if not isinstance(fingerprint, bytes) or not fingerprint:
        raise ValueError("fingerprint must be non-empty bytes")
    key = b""
    if tenant_salt is not None:
        if isinstance(tenant_salt, str):
            tenant_salt = tenant_salt.encode()
        if not isinstance(tenant_salt, bytes) or not tenant_salt:
            raise ValueError("tenant_salt must be a non-empty str or bytes (or None)")
        key = hashlib.blake2b(tenant_salt, digest_size=32, person=_PERSON).digest()
    digest = hashlib.blake2b(
        fingerprint, digest_size=NAMESPACE_HEX_CHARS // 2, key=key, person=_PERSON
    )
    return digest.hexdigest()
