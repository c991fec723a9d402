"""A tier that forwards every call to a real tier.

Subclasses delay, count or fail calls of a real tier for fault drills and tests
(``kvtier.bench.fault_spec``'s slow disk); the bytes always come from the real
tier, never from a fake.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiers.base import Tier, TierEvent
from kvtier.tiers.blockfile import BytesLike


class DelegatingTier(Tier):
    """Owns ``inner`` (closed with it) and answers every call through it."""

    def __init__(self, inner: Tier) -> None:
        self.inner, self.name, self.namespace = inner, inner.name, inner.namespace
        self.remote = inner.remote

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.contains(keys)

    def contains_waiting(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.contains_waiting(keys)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        return self.inner.get_into(keys, buffers)

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        return self.inner.get(keys)

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        return self.inner.put(items)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(keys)

    def stats(self) -> dict[str, int | float | str]:
        return self.inner.stats()

    def take_events(self) -> list[TierEvent]:
        return self.inner.take_events()

    def debug_state(self) -> dict[str, int]:
        return self.inner.debug_state()

    @property
    def available(self) -> bool:
        return self.inner.available

    @property
    def serving(self) -> bool:
        # a subclass that takes the tier away (``available`` False) does so here too
        return self.available and self.inner.serving

    def close(self) -> None:
        self.inner.close()
