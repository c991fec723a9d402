"""The checksummed block format shared by the disk and Redis tiers.

This module is the ONE definition of the layout. Every value a secondary tier
stores is a header followed by the payload (the block's bytes)::

    offset  size  field
    0       4     magic b"KVTB"
    4       2     format version (FORMAT_VERSION), little-endian like all fields
    6       1     checksum algorithm (CHECKSUM_XXH3_128 = 1)
    7       1     flags (0; readers reject other values)
    8       2     namespace length N (1..MAX_NAMESPACE_BYTES)
    10      2     key length K (1..MAX_KEY_BYTES)
    12      4     reserved (0)
    16      8     payload length L
    24      16    checksum: xxh3-128 over bytes [0, 24) of this header, then
                  the namespace, the key and the payload (big-endian digest)
    40      N     namespace (ASCII, see ``kvtier.tiers.namespace``)
    40+N    K     key (``kvtier.block_key`` bytes)
    40+N+K  L     payload

The checksum covers every other byte of the value, so a flipped bit anywhere
(header, namespace, key or payload) is detected, and a value is only accepted
for the namespace and key it was written under. A reader knows the namespace
and key it asks for, hence the header's size, and can read header and payload
with one call (see :func:`header_size`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

import xxhash

from kvtier.errors import KVTierError

MAGIC: Final = b"KVTB"
FORMAT_VERSION: Final = 1
CHECKSUM_XXH3_128: Final = 1
MAX_NAMESPACE_BYTES: Final = 64
MAX_KEY_BYTES: Final = 1024
CHECKSUM_BYTES: Final = 16

_FIXED = struct.Struct("<4sHBBHHIQ16s")
FIXED_HEADER_BYTES: Final = _FIXED.size  # 40
_DIGESTED = 24  # bytes of the fixed header before the checksum field
_PREFIX = struct.Struct("<4sHBBHHIQ")
assert _PREFIX.size == _DIGESTED and FIXED_HEADER_BYTES == 40

BytesLike = Any
"""Anything exposing a C-contiguous buffer: bytes, bytearray, memoryview, a
numpy uint8 array such as ``SlotRegion.slot_array(i)``."""


class CorruptBlockError(KVTierError, ValueError):
    """A stored value failed a check; ``reason`` says which (for counters/events)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"corrupt kvtier block: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


def byte_view(buf: BytesLike, *, writable: bool = False) -> memoryview:
    """``buf`` as a flat unsigned-byte memoryview (no copy).

    Raises ``TypeError`` for objects without a buffer, ``ValueError`` for a
    non-contiguous buffer or, with ``writable``, a read-only one.
    """
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(
            f"expected a bytes-like object (bytes, bytearray, memoryview, numpy uint8 "
            f"array), got {type(buf).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("block buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _check_ident(namespace: bytes, key: bytes) -> None:
    if type(namespace) is not bytes or not 1 <= len(namespace) <= MAX_NAMESPACE_BYTES:
        raise ValueError(
            f"namespace must be 1..{MAX_NAMESPACE_BYTES} bytes, got {namespace!r:.80}"
        )
    if type(key) is not bytes:
        raise TypeError(f"key must be bytes (see kvtier.block_key), not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)} bytes")


def header_size(namespace: bytes, key: bytes) -> int:
    """Bytes of the header of a value stored under ``namespace`` and ``key``."""
    return FIXED_HEADER_BYTES + len(namespace) + len(key)


def _digest(prefix: bytes, namespace: bytes, key: bytes, payload: memoryview) -> bytes:
    h = xxhash.xxh3_128(prefix)
    h.update(namespace)
    h.update(key)
    h.update(payload)
    return h.digest()


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A parsed header; ``size`` is its length in bytes (where the payload starts)."""

    namespace: bytes
    key: bytes
    payload_len: int
    checksum: bytes
    version: int = FORMAT_VERSION
    algorithm: int = CHECKSUM_XXH3_128

    @property
    def size(self) -> int:
        return header_size(self.namespace, self.key)

    def _prefix(self) -> bytes:
        return _PREFIX.pack(
            MAGIC, self.version, self.algorithm, 0,
            len(self.namespace), len(self.key), 0, self.payload_len,
        )


def pack_header(namespace: bytes, key: bytes, payload: BytesLike) -> bytes:
    """The header of ``payload`` stored under ``namespace``/``key`` (checksum computed)."""
    _check_ident(namespace, key)
    view = byte_view(payload)
    prefix = _PREFIX.pack(
        MAGIC, FORMAT_VERSION, CHECKSUM_XXH3_128, 0, len(namespace), len(key), 0, view.nbytes
    )
    return prefix + _digest(prefix, namespace, key, view) + namespace + key


def encode(namespace: bytes, key: bytes, payload: BytesLike) -> bytes:
    """Header and payload as one bytes value (one copy of the payload)."""
    view = byte_view(payload)
    return b"".join((pack_header(namespace, key, view), view))


def unpack_header(
    buf: BytesLike, *, namespace: bytes | None = None, key: bytes | None = None
) -> BlockHeader:
    """Parse the header at the start of ``buf`` (which may hold the payload too).

    Checks magic, version, algorithm, flags, lengths and, when given, that the
    value was written under ``namespace`` and ``key``. Raises
    :class:`CorruptBlockError`; the checksum is checked by :func:`verify`.
    """
    view = byte_view(buf)
    if view.nbytes < FIXED_HEADER_BYTES:
        raise CorruptBlockError("truncated", f"{view.nbytes} bytes, header needs 40")
    magic, version, algo, flags, ns_len, key_len, reserved, length, checksum = (
        _FIXED.unpack_from(view)
    )
    if magic != MAGIC:
        raise CorruptBlockError("bad magic", repr(magic))
    if version != FORMAT_VERSION:
        raise CorruptBlockError("unsupported version", str(version))
    if algo != CHECKSUM_XXH3_128:
        raise CorruptBlockError("unknown checksum algorithm", str(algo))
    if flags or reserved:
        raise CorruptBlockError("reserved bits set")
    if not (1 <= ns_len <= MAX_NAMESPACE_BYTES and 1 <= key_len <= MAX_KEY_BYTES):
        raise CorruptBlockError("bad identity lengths", f"{ns_len}, {key_len}")
    end = FIXED_HEADER_BYTES + ns_len + key_len
    if view.nbytes < end:
        raise CorruptBlockError("truncated", f"{view.nbytes} bytes, header needs {end}")
    ns = bytes(view[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + ns_len])
    k = bytes(view[FIXED_HEADER_BYTES + ns_len : end])
    if namespace is not None and ns != namespace:
        raise CorruptBlockError("namespace mismatch")
    if key is not None and k != key:
        raise CorruptBlockError("key mismatch")
    return BlockHeader(ns, k, length, checksum, version, algo)


def verify(header: BlockHeader, payload: BytesLike) -> None:
    """Raise :class:`CorruptBlockError` unless ``payload`` matches ``header``."""
    view = byte_view(payload)
    if view.nbytes != header.payload_len:
        raise CorruptBlockError(
            "length mismatch", f"header says {header.payload_len}, got {view.nbytes}"
        )
    if _digest(header._prefix(), header.namespace, header.key, view) != header.checksum:
        raise CorruptBlockError("checksum mismatch")


def decode(value: BytesLike, namespace: bytes, key: bytes) -> memoryview:
    """Check a whole stored value and return a view of its payload (no copy)."""
    view = byte_view(value)
    header = unpack_header(view, namespace=namespace, key=key)
    payload = view[header.size :]
    verify(header, payload)
    return payload
