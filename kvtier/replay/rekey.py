"""The same trace under other block hashes: ``kvtier replay --key-seed S``.

A trace's hash ids only say which blocks are equal; the bytes a key gets from
them are an accident of the trace's numbering. A policy that samples keys by
their bytes (the default's shadow caches, ``kvtier.policies.adaptive``, keep
the keys whose CRC-32 falls in a slice of the hash space) sees another sample
of the blocks under other bytes. In a server the bytes are vLLM's block
hashes, which follow the tokens, the hash algorithm and its seed
(``prefix_caching_hash_algo``; sha256, the default, has a fixed seed, the
non-cryptographic ones a random one per process unless ``PYTHONHASHSEED``
is set), so each deployment and workload is one draw as well. One replay is
one draw of that sample; replays under several seeds show how much of a
figure is the draw. Policies that never read key bytes (LRU, ARC) give
the same figures under every seed.

Seed 0 keeps the trace's own ids. Seed S >= 1 maps each id through a keyed
BLAKE2b (key: S) to a 64-bit id: equal ids stay equal, and so does every
request's prefix structure; distinct ids stay distinct (checked: two ids
that land on one would merge two blocks, and raise ``ValueError`` rather than
replay a different trace).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from kvtier.replay.trace import TraceRequest

_ID_BYTES = 8
"""Bytes of a re-keyed id: ``kvtier.keys.block_key`` takes ids below 2**64."""


def rekeyed(requests: Sequence[TraceRequest], seed: int) -> list[TraceRequest]:
    """``requests`` with every hash id mapped by key seed ``seed`` (module doc).

    Memory: one dict entry per distinct hash id, for the call's duration.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"key seed must be an int in [0, 2**64), got {seed!r}")
    bad = next((r for r in requests if not isinstance(r, TraceRequest)), None)
    if bad is not None:
        raise TypeError(f"rekeyed takes TraceRequests (kvtier.replay.trace), "
                        f"got {type(bad).__name__}")
    if seed == 0:
        return list(requests)
    key = seed.to_bytes(_ID_BYTES, "big")
    mapping: dict[int, int] = {}
    taken: set[int] = set()
    out = []
    for request in requests:
        ids = []
        for hash_id in request.hash_ids:
            new = mapping.get(hash_id)
            if new is None:
                new = _rekey(hash_id, key)
                if new in taken:
                    raise ValueError(f"key seed {seed} maps two hash ids to {new}; "
                                     f"use another seed")
                taken.add(new)
                mapping[hash_id] = new
            ids.append(new)
        out.append(replace(request, hash_ids=tuple(ids)))
    return out


def _rekey(hash_id: int, key: bytes) -> int:
    """``hash_id``'s id under ``key`` (a keyed BLAKE2b of its decimal digits)."""
    digest = hashlib.blake2b(b"%d" % hash_id, digest_size=_ID_BYTES, key=key).digest()
    return int.from_bytes(digest, "big")
