"""Adaptive Replacement Cache (Megiddo & Modha), per-request accesses."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from kvtier.policies.base import EvictionPolicy
from kvtier.policies.order import KeyOrder, take


class ARCPolicy(EvictionPolicy):
    """Balances recency (T1) against reuse (T2) with ghost lists B1/B2.

    Owns four lists, least recent first: T1 (blocks not reused since they
    were stored; a :class:`~kvtier.policies.order.KeyOrder`, one dict entry
    per block, since every new block enters it), T2 (blocks a request found
    ready and reused) and the ghosts B1/B2 (keys recently evicted from T1/T2),
    ordered dicts, plus ``target`` (the desired size of T1). Invariants: T1
    and T2 are disjoint and hold exactly the resident blocks; ``len(B1) +
    len(T1) <= capacity``, ``len(B2) <= capacity``; ``0 <= target <=
    capacity``; so at most ``2 * capacity`` ghosts (``capacity - len(T1)``
    in B1, ``capacity`` in B2), each keeping its key alive.

    New blocks enter T1. A request that reuses a ready block moves it to T2
    once (its access is applied once, at finish). A store miss found in a
    ghost list moves ``target`` toward the list that would have kept it.
    """

    name = "arc"
    wants_store_misses = True
    wants_running_order = True
    reads_key_bytes = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target = 0.0
        self._t1 = KeyOrder()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def ghost_sizes(self) -> tuple[int, int]:
        """Lengths of B1 and B2."""
        return len(self._b1), len(self._b2)

    def sizes(self) -> dict[str, int]:
        """Entries of T1, T2, B1 and B2 (B1 + T1 <= capacity, B2 <= capacity)."""
        return {"t1": len(self._t1), "t2": len(self._t2),
                "b1": len(self._b1), "b2": len(self._b2)}

    def insert(self, keys: list[bytes]) -> None:
        for ghost in (self._b1, self._b2):
            if ghost:
                for key in ghost.keys() & keys:  # a set: the order of deletions is irrelevant
                    del ghost[key]
        self._t1.add_many(keys)
        self._trim_ghosts()

    def keep_ahead(self, run: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        self._t1.keep_run_ahead(run, keys, start, new)  # T2 keys keep their place

    def end_run(self, run: object) -> None:
        self._t1.end_run(run)

    def remove(self, key: bytes) -> None:
        if not self._t1.discard(key):
            self._t2.pop(key, None)

    def on_store_misses(self, keys: list[bytes]) -> list[bytes]:
        b1, b2 = self._b1, self._b2
        if not (b1 or b2):
            return []
        seen = [k for k in keys if k in b1 or k in b2]
        for key in seen:
            if key in b1:
                step = max(1.0, len(b2) / len(b1))
                self.target = min(self.target + step, float(self.capacity))
            else:
                step = max(1.0, len(b1) / len(b2))
                self.target = max(self.target - step, 0.0)
        return seen

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        # Key by key, tail first: a T1 key reused moves to T2's end, another T1
        # key to T1's end, a T2 key to T2's end. T1's moves are made together at
        # the end (its final order depends only on the keys it keeps, in turn).
        t1, t2 = self._t1, self._t2
        stay: list[bytes] = []
        promoted: list[bytes] = []
        for key in reversed(keys):
            if key in t2:
                t2.move_to_end(key)
            elif key in reused and key in t1:
                promoted.append(key)
                t2[key] = None
            else:
                stay.append(key)  # in T1, or absent
        if promoted:
            t1.discard_many(promoted)
        t1.move_present(stay)

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        # REPLACE takes from T1 while |T1| > target, so the first
        # ceil(|T1| - target) victims come from T1, the rest from T2; a list
        # without enough evictable blocks leaves its share to the other.
        want_t1 = min(n, max(0, math.ceil(len(self._t1) - self.target)))
        if want_t1 == n:  # the common case: T1 alone pays, if it can
            victims = self._t1.take_oldest(n, self.blocked, protected)
            if victims is not None:
                b1 = self._b1
                for key in victims:
                    b1[key] = None
                self._trim_ghosts()
                return victims
        t1_iter, t2_iter = iter(self._t1), iter(self._t2)
        from_t1 = self._take(t1_iter, want_t1, protected)
        from_t2 = self._take(t2_iter, n - len(from_t1), protected)
        if len(from_t1) + len(from_t2) < n:
            from_t1 += self._take(t1_iter, n - len(from_t1) - len(from_t2), protected)
            if len(from_t1) + len(from_t2) < n:
                return None
        skipped = (self.blocked, protected)
        self._retire(from_t1, self._t1, self._b1, skipped)
        self._retire(from_t2, self._t2, self._b2, skipped)
        self._trim_ghosts()
        return from_t1 + from_t2

    def _take(self, entries: Iterator[bytes], k: int, protected: Container[bytes]) -> list[bytes]:
        """The next ``k`` evictable keys of ``entries`` (fewer when it runs out)."""
        return take(entries, k, self.blocked, protected)

    @staticmethod
    def _retire(
        keys: list[bytes], live: OrderedDict[bytes, None] | KeyOrder,
        ghost: OrderedDict[bytes, None], skipped: tuple[Container[bytes], ...],
    ) -> None:
        if isinstance(live, KeyOrder):
            if keys:
                live.evicted(keys, *skipped)
        else:
            for key in keys:
                del live[key]
        for key in keys:
            ghost[key] = None

    def _trim_ghosts(self) -> None:
        b1, b2, cap = self._b1, self._b2, self.capacity
        for _ in range(min(len(b1), len(b1) + len(self._t1) - cap)):
            b1.popitem(last=False)
        for _ in range(len(b2) - cap):
            b2.popitem(last=False)

    def clear(self) -> None:
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()  # (KeyOrder and OrderedDict alike)
        self.blocked.clear()
        self.target = 0.0
