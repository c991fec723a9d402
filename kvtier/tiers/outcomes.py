"""What recent promotions ended in: keys that failed, and where the others came from."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PromotionOutcomes:
    """The cascade's memory of finished promotions, both maps bounded.

    Owns ``failed`` (key -> the monotonic time until which a lookup of it is a
    MISS, so a block whose promotion failed is not retried in a loop) and
    ``sources`` (promoted key -> the tier it was read from), each an ordered
    map of at most ``max_keys`` entries, the least recently written dropped
    first. An expired failure is dropped when it is next looked up.
    """

    __slots__ = ("failure_ttl_s", "max_keys", "failed", "sources")

    def __init__(self, failure_ttl_s: float, max_keys: int) -> None:
        self.failure_ttl_s = float(failure_ttl_s)
        self.max_keys = max_keys
        self.failed: OrderedDict[bytes, float] = OrderedDict()
        self.sources: OrderedDict[bytes, str] = OrderedDict()

    def failed_recently(self, key: bytes, now: float) -> bool:
        """Whether a promotion of ``key`` failed less than ``failure_ttl_s`` ago."""
        until = self.failed.get(key)
        if until is None:
            return False
        if now < until:
            return True
        del self.failed[key]
        return False

    def note_failures(self, keys: Sequence[bytes], now: float) -> None:
        """``keys`` failed now: each is a miss for ``failure_ttl_s``."""
        failed, until = self.failed, now + self.failure_ttl_s
        for key in keys:
            failed[key] = until
            failed.move_to_end(key)
        while len(failed) > self.max_keys:
            failed.popitem(last=False)

    def note_source(self, key: bytes, tier: str) -> None:
        """``key`` was promoted from ``tier``."""
        sources = self.sources
        sources[key] = tier
        sources.move_to_end(key)
        if len(sources) > self.max_keys:
            sources.popitem(last=False)

    def clear(self) -> None:
        self.failed.clear()
        self.sources.clear()
