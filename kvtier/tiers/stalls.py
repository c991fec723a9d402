"""Lower tiers whose reads hang: no new promotions go to them.

A promotion reserves CPU slots, and a read running past the cascade's
``promotion_timeout_s`` keeps them until its thread returns (the bytes of a
slot being written are never handed to another block). Without a stop, a tier
that hangs would take every new promotion too, each holding more slots, until
the CPU tier has none left for stores. :class:`StalledTiers` tracks the
promotions running per tier and, once per scheduling step, which tiers have one
overdue; the cascade sends no promotion to those until it returns, so a
hanging tier holds the slots of the reads it already had, no more.
"""

from __future__ import annotations

from kvtier.tiers.base import Tier
from kvtier.tiers.io_pool import PromotionJob


class StalledTiers:
    """Promotions submitted and not yet applied, by the tier each reads first,
    and the tiers found stalled at the last :meth:`check`.

    Owns ``_running`` (tier id -> job id -> job), at most the I/O pool's queued
    and running promotions plus the ones a reset abandoned (until their
    threads return), and ``_stalled`` (ids of tiers with a job older than
    ``timeout_s`` at the last check). Scheduler thread only.
    """

    __slots__ = ("timeout_s", "_running", "_stalled")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._running: dict[int, dict[int, PromotionJob]] = {}
        self._stalled: frozenset[int] = frozenset()

    def __len__(self) -> int:
        """Promotions tracked."""
        return sum(map(len, self._running.values()))

    def started(self, job: PromotionJob) -> None:
        """``job`` was handed to the I/O pool."""
        self._running.setdefault(id(job.tiers[0]), {})[id(job)] = job

    def ended(self, job: PromotionJob) -> None:
        """``job``'s thread returned and the cascade applied it."""
        jobs = self._running.get(id(job.tiers[0]))
        if jobs is not None:
            jobs.pop(id(job), None)
            if not jobs:
                del self._running[id(job.tiers[0])]

    def check(self, now: float) -> None:
        """Find the tiers with a promotion running longer than ``timeout_s``."""
        limit = now - self.timeout_s
        self._stalled = frozenset(
            tier for tier, jobs in self._running.items()
            if any(job.started < limit for job in jobs.values()))

    def stalled(self, tier: Tier) -> bool:
        """Whether ``tier`` had an overdue promotion at the last check."""
        return id(tier) in self._stalled
