"""Block keys: the engine's block hash followed by the KV-cache group index.

The layout is the one of vLLM's ``OffloadKey`` (hash bytes + 4-byte big-endian
group index), so keys pass through the vLLM adapter unchanged. This module is
the single definition of that layout.
"""

from __future__ import annotations

from operator import countOf

GROUP_BYTES = 4
"""Width of the big-endian KV-cache group index that ends every key."""

_MAX_GROUP = (1 << (8 * GROUP_BYTES)) - 1
_INT_HASH_BYTES = 8


def block_key(block_hash: bytes | int, group: int = 0) -> bytes:
    """Return the key of block ``block_hash`` in KV-cache group ``group``.

    ``block_hash`` is the engine's hash bytes; a non-negative int below 2**64
    (a trace's hash id) is accepted and encoded as 8 big-endian bytes.
    """
    if isinstance(block_hash, bool) or not isinstance(block_hash, (bytes, int)):
        raise TypeError(
            f"block_hash must be bytes or int, not {type(block_hash).__name__}"
        )
    if isinstance(block_hash, int):
        if not 0 <= block_hash < 1 << (8 * _INT_HASH_BYTES):
            raise ValueError(f"int block_hash must be in [0, 2**64), got {block_hash}")
        block_hash = block_hash.to_bytes(_INT_HASH_BYTES, "big")
    elif not block_hash:
        raise ValueError("block_hash must not be empty")
    if isinstance(group, bool) or not isinstance(group, int):
        raise TypeError(f"group must be int, not {type(group).__name__}")
    if not 0 <= group <= _MAX_GROUP:
        raise ValueError(f"group must be in [0, {_MAX_GROUP}], got {group}")
    return block_hash + group.to_bytes(GROUP_BYTES, "big")


def key_group(key: bytes) -> int:
    """Return the KV-cache group index encoded at the end of ``key``."""
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def key_hash(key: bytes) -> bytes:
    """Return the block-hash part of ``key``."""
    return key[:-GROUP_BYTES]


def check_keys(keys: object, what: str = "keys") -> list[bytes]:
    """Return ``keys`` as a list, raising ``TypeError`` unless every key is bytes.

    A str or bytes passed where a collection of keys is expected is rejected
    rather than iterated element by element. The common case costs one C-level
    pass (counting the keys whose type is ``bytes``); the slow path only runs to
    name the bad key.
    """
    if type(keys) is list:
        out: list[bytes] = keys.copy()
    elif isinstance(keys, (str, bytes, bytearray)) or not hasattr(keys, "__iter__"):
        raise TypeError(
            f"{what} must be a collection of bytes keys, not {type(keys).__name__}"
        )
    else:
        out = list(keys)
    if countOf(map(type, out), bytes) != len(out):
        bad = next(k for k in out if type(k) is not bytes)
        raise TypeError(
            f"{what}: every key must be bytes (see kvtier.block_key), "
            f"got {type(bad).__name__}: {bad!r:.60}"
        )
    return out
