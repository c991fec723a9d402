"""Adaptive Replacement Cache (Megiddo & Modha), per-request accesses."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from kvtier.policies.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    """Balances recency (T1) against reuse (T2) with ghost lists B1/B2.

    Owns four ordered dicts, least recent first: T1 (blocks not reused since
    they were stored), T2 (blocks a request found ready and reused), and the
    ghosts B1/B2 (keys recently evicted from T1/T2), plus ``target`` (the
    desired size of T1). Invariants: T1 and T2 are disjoint and hold exactly
    the resident blocks; ``len(B1) + len(T1) <= capacity``, ``len(B2) <=
    capacity``; ``0 <= target <= capacity``.

    New blocks enter T1. A request that reuses a ready block moves it to T2
    once (its access is applied once, at finish). A store miss found in a
    ghost list moves ``target`` toward the list that would have kept it.
    """

    name = "arc"
    wants_store_misses = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def ghost_sizes(self) -> tuple[int, int]:
        """Lengths of B1 and B2."""
        return len(self._b1), len(self._b2)

    def insert(self, keys: list[bytes]) -> None:
        for ghost in (self._b1, self._b2):
            if ghost:
                for key in [k for k in keys if k in ghost]:
                    del ghost[key]
        t1 = self._t1
        for key in keys:  # OrderedDict.update is several times slower than this loop
            t1[key] = None

    def remove(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
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
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in t1:
                if key in reused:
                    del t1[key]
                    t2[key] = None
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        from_t1: list[bytes] = []
        from_t2: list[bytes] = []
        t1_iter, t2_iter = iter(self._t1), iter(self._t2)
        t1_size = len(self._t1)
        for _ in range(n):
            if t1_size > self.target:
                key = self._next_victim(t1_iter, protected)
                if key is None:
                    key = self._next_victim(t2_iter, protected)
                    if key is None:
                        return None
                    from_t2.append(key)
                    continue
            else:
                key = self._next_victim(t2_iter, protected)
                if key is None:
                    key = self._next_victim(t1_iter, protected)
                    if key is None:
                        return None
                    from_t1.append(key)
                    t1_size -= 1
                    continue
                from_t2.append(key)
                continue
            from_t1.append(key)
            t1_size -= 1
        self._retire(from_t1, self._t1, self._b1)
        self._retire(from_t2, self._t2, self._b2)
        self._trim_ghosts()
        return from_t1 + from_t2

    def _next_victim(self, entries: Iterator[bytes], protected: Container[bytes]) -> bytes | None:
        blocked = self.blocked
        for key in entries:
            if key not in blocked and key not in protected:
                return key
        return None

    @staticmethod
    def _retire(
        keys: list[bytes], live: OrderedDict[bytes, None], ghost: OrderedDict[bytes, None]
    ) -> None:
        for key in keys:
            del live[key]
            ghost[key] = None

    def _trim_ghosts(self) -> None:
        b1, b2, cap = self._b1, self._b2, self.capacity
        while b1 and len(b1) + len(self._t1) > cap:
            b1.popitem(last=False)
        while len(b2) > cap:
            b2.popitem(last=False)

    def clear(self) -> None:
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()
        self.blocked.clear()
        self.target = 0.0
