"""Upper bounds on any policy's hit ratio: Belady's OPT and the infinite cache.

Both count block hits on the flat sequence of block accesses (every block of
every request, in order), as data/mooncake/README.md defines its OPT column.
A prefix hit is a block hit, so no policy's prefix-hit ratio exceeds them.

OPT (Belady's MIN with bypass): on a miss with the cache full, the block whose
next use is farthest in the future leaves, or the missing block is not kept at
all when its own next use is the farthest. That is the optimum for a cache
that may decline to keep a block. O(N log C) time: each access's next use is
found once by a backward scan, and a max-heap of (next use, block) with lazy
deletion finds the farthest resident block.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

NEVER = 1 << 62
"""Next-use index of an access whose block is never used again."""


@dataclass(frozen=True, slots=True)
class BoundResult:
    """Block hits of a bound over a trace; ``stores`` blocks kept, ``evictions`` dropped."""

    accesses: int
    hits: int
    stores: int
    evictions: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def flatten(requests: Iterable[Sequence[Hashable]]) -> list[Hashable]:
    """The flat sequence of block accesses, request after request."""
    return [key for request in requests for key in request]


def next_uses(seq: Sequence[Hashable]) -> list[int]:
    """For each access, the index of the next access of the same block (``NEVER``)."""
    nxt = [NEVER] * len(seq)
    last: dict[Hashable, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        key = seq[i]
        nxt[i] = last.get(key, NEVER)
        last[key] = i
    return nxt


def belady(seq: Sequence[Hashable], capacity: int,
           nxt: Sequence[int] | None = None) -> BoundResult:
    """Belady's OPT (with bypass) for a cache of ``capacity`` blocks over ``seq``.

    ``nxt`` may pass ``next_uses(seq)`` computed once for several capacities.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    if nxt is None:
        nxt = next_uses(seq)
    resident: dict[Hashable, int] = {}  # block -> its next use
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, tie, block), stale entries allowed
    push, pop = heapq.heappush, heapq.heappop
    hits = stores = evictions = 0
    for t, key in enumerate(seq):
        nu = nxt[t]
        if key in resident:
            hits += 1
            resident[key] = nu
            push(heap, (-nu, t, key))
            continue
        if nu == NEVER:
            continue  # never used again: keeping it cannot help
        if len(resident) >= capacity:
            while True:  # drop stale entries until the top is a live one
                neg, _, victim = heap[0]
                if resident.get(victim) == -neg:
                    break
                pop(heap)
            if -neg <= nu:
                continue  # every resident block is needed sooner: bypass
            pop(heap)
            del resident[victim]
            evictions += 1
        resident[key] = nu
        push(heap, (-nu, t, key))
        stores += 1
        if len(heap) > 4 * capacity + 64:  # bound the stale entries
            heap = [(-n, i, k) for i, (k, n) in enumerate(resident.items())]
            heapq.heapify(heap)
    return BoundResult(len(seq), hits, stores, evictions)


def infinite(seq: Sequence[Hashable]) -> BoundResult:
    """An unbounded cache: every access but a block's first is a hit."""
    distinct = len(set(seq))
    return BoundResult(len(seq), len(seq) - distinct, distinct, 0)
