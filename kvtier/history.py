"""Bounded memory of recent evictions, for explaining misses."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Final

DEFAULT_EVICTION_HISTORY_SIZE: Final = 10_000
"""Evicted keys remembered by default (``eviction_history_size``)."""

class EvictionHistory:
    """Key -> monotonic time of its last eviction, for recently evicted keys.

    Owns a dict in eviction order, never longer than ``max_size`` (0 disables
    it): when full its oldest entries are deleted in place down to the newest
    three quarters, so it remembers between 3/4 and all of the last
    ``max_size`` evicted keys at an amortised constant cost. Deleted entries
    leave holes in the dict's storage until its next resize compacts them, so
    the storage stays proportional to ``max_size``. One clock read per
    eviction batch.
    """

    __slots__ = ("max_size", "_when")

    def __init__(self, max_size: int) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0:
            raise ValueError(f"eviction_history_size must be an int >= 0, got {max_size!r}")
        self.max_size = max_size
        self._when: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._when)

    def record(self, keys: Iterable[bytes]) -> None:
        """Remember that ``keys`` were evicted now."""
        if not self.max_size:
            return
        now = time.monotonic()
        when = self._when
        keys = list(keys)
        for key in when.keys() & keys:  # re-evicted keys move to the end
            del when[key]
        for key in keys:
            when[key] = now
        if len(when) > self.max_size:
            self._forget_oldest(len(when) - self.max_size * 3 // 4)

    def _forget_oldest(self, n: int) -> None:
        """Delete the ``n`` oldest evictions (cheaper than copying the rest)."""
        when = self._when
        for key in list(itertools.islice(when, n)):
            del when[key]

    def evicted_at(self, key: bytes) -> float | None:
        """Monotonic time of ``key``'s last remembered eviction, or None."""
        return self._when.get(key)

    def span_seconds(self, now: float) -> float:
        """Seconds from the oldest remembered eviction to ``now`` (0 when empty)."""
        if not self._when:
            return 0.0
        return now - next(iter(self._when.values()))

    def clear(self) -> None:
        """Forget every eviction."""
        self._when.clear()
