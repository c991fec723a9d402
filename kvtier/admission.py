"""Admission by offer count (``store_threshold``): one-off blocks stay out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

DEFAULT_MAX_TRACKER_SIZE: Final = 64_000
"""Keys whose offer counts are kept by default (``max_tracker_size``)."""


class AdmissionTracker:
    """Counts how often each key was offered for storing, once per request.

    Owns an ``OrderedDict`` key -> count, least recently offered first, holding
    at most ``max_size`` entries (the bound). Invariants:

    * a key is counted at most once per request (the caller passes the
      request's ``counted`` set); a repeated offer only refreshes its place;
    * while one offer is being recorded, keys of that offer already tracked
      form a suffix of the order, so evicting from the front never drops a key
      of the current offer; when every entry belongs to the current offer, new
      keys are not tracked;
    * ``record`` is linear in the offer's length.
    """

    __slots__ = ("threshold", "max_size", "_counts")

    def __init__(self, threshold: int, max_size: int) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"store_threshold must be an int >= 1, got {threshold!r}")
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_tracker_size must be an int >= 1, got {max_size!r}")
        self.threshold = threshold
        self.max_size = max_size
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def count(self, key: bytes) -> int:
        """Offers of ``key`` counted so far (0 when untracked)."""
        return self._counts.get(key, 0)

    def record(
        self, candidates: Sequence[bytes], counted: set[bytes]
    ) -> tuple[list[bytes], list[bytes]]:
        """Count ``candidates`` (distinct new keys of one offer); return (admitted, skipped).

        ``counted`` is the request's set of keys already counted; it is updated.
        ``admitted`` keeps the order of ``candidates``. The tracker is probed
        once per key; only an offer mixing tracked and new keys is scanned twice.
        """
        counts = self._counts
        tracked = [k for k in candidates if k in counts]
        if len(tracked) == len(candidates):
            return self._count_tracked(tracked, counted)
        if tracked:
            fresh = [k for k in candidates if k not in counts]
            admitted, skipped = self._count_tracked(tracked, counted)
            skipped += fresh
        else:
            fresh = list(candidates)
            admitted, skipped = [], fresh
        self._track_fresh(fresh, counted, protected=len(tracked))
        if self.threshold <= 1:  # only reachable when the class is used directly
            return [k for k in candidates if k in counts], []
        return admitted, skipped

    def _count_tracked(
        self, tracked: list[bytes], counted: set[bytes]
    ) -> tuple[list[bytes], list[bytes]]:
        """Refresh and count (once per request) keys already tracked."""
        counts = self._counts
        move = counts.move_to_end
        if counted:
            for key in tracked:
                move(key)
            to_count = [k for k in tracked if k not in counted]
            for key in to_count:
                counts[key] += 1
        else:  # the request's first offer: every key counts
            to_count = tracked
            for key in tracked:
                move(key)
                counts[key] += 1
        counted.update(to_count)
        threshold = self.threshold
        admitted = [k for k in tracked if counts[k] >= threshold]
        if len(admitted) == len(tracked):
            return admitted, []
        return admitted, [k for k in tracked if counts[k] < threshold]

    def _track_fresh(self, fresh: list[bytes], counted: set[bytes], protected: int) -> None:
        """Start counting untracked keys, evicting only entries outside the offer.

        Tracked keys of the offer were just moved to the end, so the front
        ``len(counts) - protected`` entries are exactly the unprotected ones.
        """
        counts = self._counts
        overflow = len(counts) + len(fresh) - self.max_size
        if overflow > 0:
            drop = min(overflow, len(counts) - protected)
            for _ in range(drop):
                counts.popitem(last=False)
            if drop < overflow:  # no room left for the last keys: they stay untracked
                fresh = fresh[: len(fresh) - (overflow - drop)]
        for key in fresh:
            counts[key] = 1
        counted.update(fresh)

    def clear(self) -> None:
        """Forget every count."""
        self._counts.clear()
