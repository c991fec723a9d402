"""Per-tier admission: how many requests used a block (DESIGN.md §7).

A lower tier with ``store_threshold = t`` receives a block only once ``t``
requests used it: hit it (in any tier) or offered it for storing. ``t = 2``
keeps one-off prompts off the SSD. The count itself is the core's
:class:`~kvtier.admission.AdmissionTracker` (once per request, least recently
used forgotten first); this module decides what the counts mean for tiers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.admission import AdmissionTracker
from kvtier.request import RequestContext


class BlockUses:
    """Use counts of blocks for tiers with thresholds ``thresholds``.

    Owns one ``AdmissionTracker`` of at most ``max_blocks`` blocks, or none
    when every threshold is 1 (nothing to count: every block is admitted).
    Each request counts at most once per block (its ``tier_counted`` set).
    """

    __slots__ = ("_tracker", "_watched")

    def __init__(self, thresholds: Iterable[int], max_blocks: int,
                 watched: Iterable[int] = ()) -> None:
        """``watched``: thresholds whose crossing :meth:`record` reports."""
        top = max(thresholds, default=1)
        self._tracker = AdmissionTracker(top, max_blocks) if top > 1 else None
        self._watched = frozenset(t for t in watched if t > 1)

    @property
    def counting(self) -> bool:
        """Whether uses are counted at all (some threshold above 1)."""
        return self._tracker is not None

    def __len__(self) -> int:
        return len(self._tracker) if self._tracker is not None else 0

    def record(self, keys: Sequence[bytes], ctx: RequestContext) -> list[bytes]:
        """Count one use of each of ``keys`` by ``ctx``; return the keys whose
        count just reached a watched threshold."""
        tracker = self._tracker
        if tracker is None:
            return []
        counted = ctx.tier_counted
        new = [k for k in dict.fromkeys(keys) if k not in counted]
        if not new:
            return []
        tracker.record(new, counted)
        if not self._watched:
            return []
        count, watched = tracker.count, self._watched
        return [k for k in new if count(k) in watched]

    def admitted(self, threshold: int, keys: list[bytes]) -> list[bytes]:
        """The ``keys`` used by at least ``threshold`` requests, in order."""
        tracker = self._tracker
        if threshold <= 1 or tracker is None:
            return keys
        count = tracker.count
        return [k for k in keys if count(k) >= threshold]

    def clear(self) -> None:
        if self._tracker is not None:
            self._tracker.clear()
