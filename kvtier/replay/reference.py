"""A cache over a trace's hash ids with the replay's rules, and the prefix-hit
ratio of a trace served by one: the base of ``kvtier foresight``
(``kvtier.replay.foresight``) and of the reference policy families in
``benchmarks/reference_policies.py``.

The rules are those of ``kvtier.replay.driver``: requests run in file order;
a request's prefix hit is the leading run of its resident blocks; its missing
blocks are stored as far as the cache admits them (a declined block declines
the rest of the offer, as kvtier's admission does), evicting blocks of other
requests only, and not at all when that cannot make room for them (the
manager refuses such an offer whole); then its blocks are used head to tail,
so its head ends most recent. ``LRUCache`` equals ``kvtier replay --policy
lru`` block for block on traces whose requests do not repeat a hash id
(tests/test_foresight.py and tests/test_replay_models.py check it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Protocol

from kvtier.argtypes import require_positive_int

PROGRESS_EVERY = 100
"""Requests between two calls of ``prefix_hit_ratio``'s progress callback."""

Requests = Sequence[Sequence[int]]
"""Each request's hash ids, head first."""


class LRUCache:
    """LRU over hash ids with the replay's order of events; subclasses decide
    which missing blocks to store (``admitted``) and may keep more state
    (``used``). Invariant: at most ``capacity`` resident blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = require_positive_int("capacity", capacity)
        self.order: OrderedDict[int, None] = OrderedDict()  # least recent first

    def __contains__(self, block: int) -> bool:
        return block in self.order

    def admitted(self, missing: list[int], room: int) -> int:
        """How many leading blocks of ``missing`` to store (``room`` fit without eviction)."""
        return len(missing)

    def used(self, ids: Sequence[int]) -> None:
        """The request's blocks were used (after its stores)."""

    def serve(self, ids: Sequence[int]) -> None:
        """Store the request's missing blocks, then use all of them head to tail."""
        order = self.order
        missing = list(dict.fromkeys(h for h in ids if h not in order))  # each block once
        if missing:
            room = self.capacity - len(order)
            missing = missing[:self.admitted(missing, room)]
            over = len(order) + len(missing) - self.capacity
            if over > 0:
                protected = set(ids)
                victims = list(islice((h for h in order if h not in protected), over))
                if len(victims) < over:
                    # as the manager's prepare_store: an offer that cannot be
                    # made room for is refused whole (None), nothing evicted
                    missing = victims = []
                for h in victims:
                    del order[h]
            for h in missing:
                order[h] = None
        for h in reversed(ids):
            if h in order:
                order.move_to_end(h)
        self.used(ids)


class Cache(Protocol):
    """What ``prefix_hit_ratio`` needs of a cache."""

    def __contains__(self, block: int) -> bool: ...

    def serve(self, ids: Sequence[int]) -> None: ...


def prefix_hit_ratio(requests: Requests, cache: Cache,
                     progress: Callable[[int], None] | None = None) -> float:
    """Prefix-hit blocks over offered blocks of ``requests`` served by ``cache``;
    ``progress(n)`` is told of every ``PROGRESS_EVERY`` requests served, and
    of the rest at the end."""
    hits = offered = 0
    for i, ids in enumerate(requests, 1):
        for h in ids:
            if h not in cache:
                break
            hits += 1
        offered += len(ids)
        cache.serve(ids)
        if progress is not None and i % PROGRESS_EVERY == 0:
            progress(PROGRESS_EVERY)
    if progress is not None and len(requests) % PROGRESS_EVERY:
        progress(len(requests) % PROGRESS_EVERY)
    return hits / offered if offered else 0.0
