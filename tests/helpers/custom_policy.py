"""Custom eviction policies loaded by ``module.path:ClassName`` in the policy tests."""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvtier.policies import EvictionPolicy


class NewestFirstPolicy(EvictionPolicy):
    """Evicts the most recently inserted evictable block and logs every hook it gets."""

    name = "newest-first"
    wants_store_misses = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: list[bytes] = []
        self.calls: list[tuple[str, object]] = []

    def __len__(self) -> int:
        return len(self.order)

    def insert(self, keys: list[bytes]) -> None:
        self.calls.append(("insert", list(keys)))
        self.order.extend(keys)

    def remove(self, key: bytes) -> None:
        self.calls.append(("remove", key))
        self.order.remove(key)

    def on_store_misses(self, keys: list[bytes]) -> list[bytes]:
        self.calls.extend(("store_miss", k) for k in keys)
        return list(keys)

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        self.calls.append(("access", (list(keys), {k for k in keys if k in reused})))

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        victims = [k for k in reversed(self.order) if k not in self.blocked and k not in protected]
        if len(victims) < n:
            return None
        victims = victims[:n]
        for key in victims:
            self.order.remove(key)
        self.calls.append(("evict", list(victims)))
        return victims

    def clear(self) -> None:
        self.order.clear()
        self.blocked.clear()


class NotAPolicy:
    """Has the right shape of name but is no EvictionPolicy."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity


class RebindingPolicy(NewestFirstPolicy):
    """Clears itself by binding fresh containers, ``blocked`` included."""

    def clear(self) -> None:
        self.order = []
        self.blocked = set()
