"""Least recently used, with per-request head-to-tail recency."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

from kvtier.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently accessed evictable block.

    Owns one ``OrderedDict`` of resident keys, least recent first. Insertion
    puts a key last; a finished request moves its keys last, tail first, so its
    head ends most recent. Non-evictable keys keep their place and are skipped
    by ``evict``. Size: one entry per resident block.
    """

    name = "lru"
    wants_reuse = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, keys: list[bytes]) -> None:
        order = self._order
        for key in keys:  # OrderedDict.update is several times slower than this loop
            order[key] = None

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        blocked = self.blocked
        victims: list[bytes] = []
        for key in self._order:
            if key in blocked or key in protected:
                continue
            victims.append(key)
            if len(victims) == n:
                break
        else:
            return None
        order = self._order
        for key in victims:
            del order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()
        self.blocked.clear()
