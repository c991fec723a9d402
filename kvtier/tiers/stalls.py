"""Lower tiers whose calls hang: no new promotions go to them.

A promotion reserves CPU slots, and a read running past the cascade's
``promotion_timeout_s`` keeps them until its thread returns (the bytes of a
slot being written are never handed to another block). Without a stop, a tier
that hangs would take every new promotion too, each holding more slots, until
the CPU tier has none left for stores. :class:`StalledTiers` tracks the
promotions running and, once per scheduling step, finds the tiers that one of
them, or a write, has been calling for too long; the cascade sends no
promotion to those until the call returns, so a hanging tier holds the slots
of the reads it already had, no more. A write that hangs counts too: the tier
is just as unlikely to answer a read, and the write holds an I/O thread. When
every I/O thread is in an overdue call, no promotion would start in time, so
none is sent to any tier.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.tiers.base import Tier
from kvtier.tiers.io_pool import PromotionJob, WriteJob


class StalledTiers:
    """Promotions submitted and not yet applied, and the tiers found stalled at
    the last :meth:`check`.

    Owns ``_running`` (job id -> job), at most the I/O pool's queued and
    running promotions plus the ones a reset abandoned (until their threads
    return); ``_stalled`` (ids of the tiers a promotion or a write job has
    been calling for longer than ``timeout_s`` at the last check: the tier its
    thread is in, ``PromotionJob.reading`` / ``WriteJob.writing``, not the
    first it was sent to, since a job falls through its tiers; time queued in
    the pool does not count); and ``_all`` (whether every one of ``threads``
    I/O threads was in such a call). Scheduler thread only.
    """

    __slots__ = ("timeout_s", "threads", "_running", "_stalled", "_all")

    def __init__(self, timeout_s: float, threads: int) -> None:
        self.timeout_s = timeout_s
        self.threads = threads
        self._running: dict[int, PromotionJob] = {}
        self._stalled: frozenset[int] = frozenset()
        self._all = False

    def __len__(self) -> int:
        """Promotions tracked."""
        return len(self._running)

    def started(self, job: PromotionJob) -> None:
        """``job`` was handed to the I/O pool."""
        self._running[id(job)] = job

    def ended(self, job: PromotionJob) -> None:
        """``job``'s thread returned and the cascade applied it, or it was
        taken back from the pool's queue before a thread ran it."""
        self._running.pop(id(job), None)

    def check(self, now: float, writes: Iterable[WriteJob] = ()) -> None:
        """Find the tiers a promotion or one of ``writes`` (the write jobs
        submitted and not yet applied) has been calling longer than ``timeout_s``."""
        limit = now - self.timeout_s
        calls = [job.reading for job in self._running.values()]
        calls += [job.writing for job in writes]
        overdue = [call for call in calls if call is not None and call[1] < limit]
        self._stalled = frozenset(id(call[0]) for call in overdue)
        self._all = len(overdue) >= self.threads

    def stalled(self, tier: Tier) -> bool:
        """Whether ``tier`` had an overdue call at the last check, or every
        I/O thread did."""
        return self._all or id(tier) in self._stalled
