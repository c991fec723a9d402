"""Lower tiers whose reads hang: no new promotions go to them.

A promotion reserves CPU slots, and a read running past the cascade's
``promotion_timeout_s`` keeps them until its thread returns (the bytes of a
slot being written are never handed to another block). Without a stop, a tier
that hangs would take every new promotion too, each holding more slots, until
the CPU tier has none left for stores. :class:`StalledTiers` tracks the
promotions running and, once per scheduling step, finds the tiers one of them
has been reading for too long; the cascade sends no promotion to those until
it returns, so a hanging tier holds the slots of the reads it already had, no
more.
"""

from __future__ import annotations

from kvtier.tiers.base import Tier
from kvtier.tiers.io_pool import PromotionJob


class StalledTiers:
    """Promotions submitted and not yet applied, and the tiers found stalled at
    the last :meth:`check`.

    Owns ``_running`` (job id -> job), at most the I/O pool's queued and
    running promotions plus the ones a reset abandoned (until their threads
    return), and ``_stalled`` (ids of the tiers a job has been reading for
    longer than ``timeout_s`` at the last check: the tier its thread is in,
    ``PromotionJob.reading``, not the first it was sent to, since a job falls
    through its tiers; time queued in the pool does not count). Scheduler
    thread only.
    """

    __slots__ = ("timeout_s", "_running", "_stalled")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._running: dict[int, PromotionJob] = {}
        self._stalled: frozenset[int] = frozenset()

    def __len__(self) -> int:
        """Promotions tracked."""
        return len(self._running)

    def started(self, job: PromotionJob) -> None:
        """``job`` was handed to the I/O pool."""
        self._running[id(job)] = job

    def ended(self, job: PromotionJob) -> None:
        """``job``'s thread returned and the cascade applied it."""
        self._running.pop(id(job), None)

    def check(self, now: float) -> None:
        """Find the tiers a promotion has been reading longer than ``timeout_s``."""
        limit = now - self.timeout_s
        reads = [job.reading for job in self._running.values()]
        self._stalled = frozenset(id(r[0]) for r in reads if r is not None and r[1] < limit)

    def stalled(self, tier: Tier) -> bool:
        """Whether ``tier`` had an overdue promotion at the last check."""
        return id(tier) in self._stalled
