"""Least recently used, with per-request head-to-tail recency."""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvtier.policies.base import EvictionPolicy
from kvtier.policies.order import KeyOrder


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently accessed evictable block.

    Owns one :class:`~kvtier.policies.order.KeyOrder` of resident keys, least
    recent first. Insertion puts a key last; a finished request moves its keys
    last, tail first, so its head ends most recent. Non-evictable keys keep
    their place and are skipped by ``evict``. Size: one dict entry per
    resident block (about 42 B at a million blocks, at most twice that).
    """

    name = "lru"
    wants_reuse = False
    wants_running_order = True
    reads_key_bytes = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order = KeyOrder()

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, keys: list[bytes]) -> None:
        self._order.add_many(keys)

    def remove(self, key: bytes) -> None:
        self._order.discard(key)

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        self._order.move_present(reversed(keys))

    def keep_ahead(self, run: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        self._order.keep_run_ahead(run, keys, start, new)

    def end_run(self, run: object) -> None:
        self._order.end_run(run)

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        return self._order.take_oldest(n, self.blocked, protected)

    def clear(self) -> None:
        self._order.clear()
        self.blocked.clear()
