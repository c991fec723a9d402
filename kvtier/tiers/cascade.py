"""The scheduler-side tier cascade: CPU slots -> disk -> Redis (DESIGN.md §7).

``TierCascade`` wraps one :class:`~kvtier.manager.OffloadManager` (the CPU
tier's metadata), the CPU slot region (the bytes) and a list of lower tiers,
fastest first. All manager calls happen on the caller's (scheduler) thread;
I/O threads (:mod:`kvtier.tiers.io_pool`) only move bytes between slots and
tiers, and their results are applied by :meth:`TierCascade.poll`.

**The step contract** (vLLM's): lookups only record work; the caller ends each
scheduling step with :meth:`TierCascade.on_schedule_end`, which submits the
step's promotions and remote existence checks as batches (one job per tier,
one pipelined round trip for Redis). A key answered HIT_PENDING or RETRY makes
progress only after that call; ask again in a later step.

**Lookups** walk CPU -> tiers. A local tier (disk) is asked directly; a remote
tier (``Tier.remote``: Redis) is asked through :class:`ExistenceProbes`, which
answers RETRY until the batched check comes back (answers are kept
``probe_ttl_s``; an unanswered check becomes "not found" after
``probe_timeout_s``, so a stuck server yields misses, not endless retries). A
lower-tier hit reserves a CPU slot (``manager.reserve``) and joins the step's
promotion batch; the key reports HIT_PENDING until the bytes are in, then it
is an ordinary CPU hit. A key already being promoted starts no second job. A
failed promotion (miss at read time, checksum mismatch, short payload, I/O
error) frees the slot and the key is a MISS for ``failure_ttl_s`` (a bounded
set), so it is not retried in a loop; a promotion running past
``promotion_timeout_s`` reports MISS at once (``promotion_timeouts``) and keeps
its slot until the thread returns: then the block is an ordinary CPU hit, or
the slot is freed if the read failed (the bytes of a slot still being
written are never handed out). Meanwhile that tier gets no new promotions
(:mod:`kvtier.tiers.stalls`; ``promotions_stalled`` counts the lookups that
passed it by), so a tier that hangs holds only the slots it already had.

**Writes** (:mod:`kvtier.tiers.cascade_writes`): each lower tier has a write
policy (``"store"``: written through as blocks are stored or reach its
admission threshold; ``"evict"``: written as the CPU tier evicts them) and a
threshold of requests that must use a block before the tier gets it.

Both I/O queues are bounded (``max_queue`` jobs each) and the threads take
promotions and probes first: under backpressure stores are dropped
(``dropped_writes``) and promotions are not started (the lookup is a MISS,
``promotions_deferred``) rather than queued without bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.events import Event
from kvtier.manager import OffloadManager
from kvtier.request import RequestContext
from kvtier.results import LookupResult, PrepareStoreOutput
from kvtier.tiers.base import Tier, WarningLimiter
from kvtier.tiers.cascade_writes import CascadeWrites
from kvtier.tiers.io_pool import IOPool, Job, ProbeJob, PromotionJob, SlotSource, WriteJob
from kvtier.tiers.lower_tier import WRITE_POLICIES, LowerTier, WritePolicy
from kvtier.tiers.outcomes import PromotionOutcomes
from kvtier.tiers.probes import (
    DEFAULT_MAX_PROBES,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_PROBE_TTL_S,
    ExistenceProbes,
)
from kvtier.tiers.stalls import StalledTiers

logger = logging.getLogger(__name__)

DEFAULT_PROMOTION_TIMEOUT_S = 2.0
"""How long a request waits for a block to come up from a lower tier before it
computes the block instead: the most a slow or stuck tier adds to its TTFT."""
DEFAULT_MAX_FAILED = 10_000
"""Failed promotions remembered as misses by default (``max_failed``)."""

RESET_WAIT_S = 1.0
"""How long ``reset`` waits for I/O jobs before abandoning them (it runs on the
scheduler's thread; an abandoned job is safe, see ``reset``)."""

SHUTDOWN_GRACE_S = 1.0
"""How long ``shutdown`` lets the tier calls already running end before it
closes the owned tiers under them (a Redis call then ends at once): with a
dead or stopped Redis, about the longest a shutdown takes."""

RegionSource = SlotSource | Callable[[], SlotSource | None]
COUNTERS = (
    "promotions", "promotion_failures", "promotion_timeouts", "promotions_deferred",
    "promotions_stalled",
    "probes", "probes_deferred", "cascade_writes", "duplicate_writes_skipped",
    "write_failures", "dropped_writes", "writes_not_admitted",
)


class TierCascade:
    """CPU -> lower tiers; see the module docstring.

    Parameters:
        manager: the CPU tier's manager; only this object calls it afterwards
            (from one thread).
        region: the slot region (``RankRegions`` for a tensor-parallel engine,
            with ``RankedTier`` tiers), or a callable returning it (None while
            it is not available yet: lookups fall back to the CPU tier, writes
            are dropped); a region the callable returned is the cascade's,
            closed by ``shutdown``.
        tiers: lower tiers, fastest first (disk, then Redis).
        write_policy: ``"store"`` (write-through) or ``"evict"`` (write on CPU
            eviction), for every tier or one per tier.
        io_threads: I/O threads shared by promotions, probes and writes.
        max_queue: queued jobs per kind (reads, writes).
        store_threshold: requests that must use a block before a tier gets it
            (one value, or one per tier).
        max_tracker_size: blocks whose uses are counted (the bound).
        async_lookups: ask remote tiers through batched probes (RETRY) rather
            than one round trip per key on the caller's thread.
        probe_ttl_s / probe_timeout_s / max_probes: see ``ExistenceProbes``.
        failure_ttl_s / max_failed: how long, and for how many keys, a failed
            promotion is remembered as a miss (``max_failed`` also bounds the
            remembered sources of successful promotions).
        promotion_timeout_s: a promotion running longer is reported as a miss
            (the request computes the block; a slow tier costs it at most this).
        own_tiers: close the tiers on ``shutdown``.
    """

    def __init__(
        self,
        manager: OffloadManager,
        region: RegionSource,
        tiers: Sequence[Tier],
        write_policy: WritePolicy | Sequence[WritePolicy] = "store",
        io_threads: int = 2,
        max_queue: int = 256,
        *,
        store_threshold: int | Sequence[int] = 1,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
        async_lookups: bool = True,
        probe_ttl_s: float = DEFAULT_PROBE_TTL_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        max_probes: int = DEFAULT_MAX_PROBES,
        failure_ttl_s: float = 10.0,
        max_failed: int = DEFAULT_MAX_FAILED,
        promotion_timeout_s: float = DEFAULT_PROMOTION_TIMEOUT_S,
        own_tiers: bool = True,
    ) -> None:
        for name, value in (("io_threads", io_threads), ("max_queue", max_queue),
                            ("max_failed", max_failed), ("max_tracker_size", max_tracker_size)):
            _check_int(name, value)
        self.manager = manager
        # The tiers below are fed from the CPU tier's slots: a block the CPU
        # policy declined would reach none of them, so the policy's own
        # admission (sized for the CPU tier alone) is off under a cascade.
        manager.store_gate.policy_admission = False
        self.tiers = list(tiers)
        probes = (probe_ttl_s, probe_timeout_s, max_probes) if async_lookups else None
        self.lower = lower_tiers(self.tiers, write_policy, store_threshold, probes)
        self._outcomes = PromotionOutcomes(failure_ttl_s, max_failed)
        self.promotion_timeout_s = float(promotion_timeout_s)
        self._own_tiers = own_tiers
        self._region_source = region
        self._region: SlotSource | None = None if callable(region) else region
        self._warn = WarningLimiter(logger)
        self._pool = IOPool(io_threads, max_queue)
        self._pool.region = self._region
        self._shut = False
        self._init_step_state(max_tracker_size)
        if self._writes.evicts:
            manager.set_eviction_listener(self._writes.on_evict)

    def _init_step_state(self, max_tracker_size: int) -> None:
        """The scheduler thread's state: the writes, promotions batching and in
        flight, counters and I/O busy time."""
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._writes = CascadeWrites(self.manager, self.lower, self._pool, self.region,
                                     self.counters, max_tracker_size)
        self._batching: dict[tuple[int, ...], PromotionJob] = {}  # this step's promotions
        self._inflight: dict[bytes, PromotionJob] = {}
        self._stalls = StalledTiers(self.promotion_timeout_s, self._pool.threads)
        self._probes_in_flight = 0
        # Seconds I/O threads spent in each tier's calls: "read" (promotions)
        # and "write" (writes with their presence check); one entry per tier.
        self._busy: dict[str, dict[str, float]] = {
            kind: dict.fromkeys((t.name for t in self.tiers), 0.0) for kind in ("read", "write")}

    # ------------------------------------------------------------ region
    def region(self) -> SlotSource | None:
        """The slot region(s), resolving a lazy source on first success."""
        if self._region is None and callable(self._region_source):
            try:
                self._region = self._region_source()
            except Exception as exc:
                self._warn.warning("kvtier cascade: slot region not available: %s", exc)
            self._pool.region = self._region
        return self._region

    # ------------------------------------------------------------ lookups
    def lookup_one(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """CPU first, then the lower tiers; see the module docstring."""
        self.poll()
        job = self._inflight.get(key)
        if job is not None:
            if time.monotonic() - job.started > self.promotion_timeout_s:
                self._note_overdue(job)
                return LookupResult.MISS
            self.manager.bind(ctx)  # a context a reset outlived counts anew
            self._writes.note_uses([key], ctx)
            return LookupResult.HIT_PENDING
        result = self.manager.lookup_one(key, ctx)
        if result is LookupResult.HIT:
            self._writes.note_uses([key], ctx)
            return result
        if result is not LookupResult.MISS or not self.lower or key in self.manager._slot:
            return result  # resident but refused (lease budget): not a tier's business
        if self._outcomes.failed_recently(key, time.monotonic()):
            return LookupResult.MISS
        return self._look_below(key, ctx)

    def is_promoting(self, key: bytes) -> bool:
        """Whether ``key`` is being promoted from a lower tier now."""
        return key in self._inflight

    def source_of(self, key: bytes) -> str | None:
        """The tier a recent promotion of ``key`` read it from (the last
        ``max_failed`` promotions are remembered), or None."""
        return self._outcomes.sources.get(key)

    def _look_below(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """Ask each available tier in order; promote from the first that holds ``key``."""
        now = time.monotonic()
        waiting = False
        for i, low in enumerate(self.lower):
            if not low.tier.available:
                continue
            if self._stalls.stalled(low.tier):  # a read of it hangs: no more slots to it
                self.counters["promotions_stalled"] += 1
                continue
            if low.probes is not None:
                found = low.probes.ask(key, now)
                if found is None:
                    waiting = True
                    continue
            else:
                found = _holds(low.tier, key)
            if found:
                return self._promote(key, ctx, i)
        return LookupResult.RETRY if waiting else LookupResult.MISS

    def _promote(self, key: bytes, ctx: RequestContext, first: int) -> LookupResult:
        """Reserve a slot for ``key`` and add it to this step's promotion batch."""
        if self.region() is None:
            return LookupResult.MISS
        order = tuple(range(first, len(self.lower)))
        if order not in self._batching and self._pool.reads_full():
            self.counters["promotions_deferred"] += 1
            return LookupResult.MISS
        slots = self.manager.reserve([key])
        if slots is None:
            return LookupResult.MISS
        for low in self.lower[first:]:
            if low.probes is not None:
                low.probes.forget(key)  # answered by the promotion itself
        job = self._batching.get(order)
        if job is None:
            tiers = [self.lower[i].tier for i in order]
            job = self._batching[order] = PromotionJob([], [], tiers, time.monotonic())
        job.keys.append(key)
        job.slots.append(slots[0])
        self._inflight[key] = job
        self._writes.note_uses([key], ctx)
        return LookupResult.HIT_PENDING

    # ------------------------------------------------------------ the step
    def on_schedule_end(self) -> None:
        """End of a scheduling step: apply finished jobs, then submit the
        step's promotions, remote existence checks and admitted writes."""
        self.poll()
        now = time.monotonic()
        self._stalls.check(now, self._writes.running.values())
        self._drop_unstarted_promotions(now)
        self._submit_promotions()
        self._submit_probes()
        self._writes.submit_due()
        # after the promotions: a write filling a lower tier must not evict a
        # block about to be read
        self._writes.submit_evicted()

    def _submit_promotions(self) -> None:
        batches, self._batching = self._batching, {}
        for job in batches.values():
            job.started = time.monotonic()
            if self._pool.submit(job):
                # counted here, not when batched: a batch the pool refuses is
                # promotions_deferred only
                self.counters["promotions"] += len(job.keys)
                self._stalls.started(job)
            else:
                self.counters["promotions_deferred"] += len(job.keys)
                for key in job.keys:
                    self._inflight.pop(key, None)
                self.manager.complete_reserve(job.keys, success=False)

    def _drop_unstarted_promotions(self, now: float) -> None:
        """Give back the slots of promotions no I/O thread took within
        ``promotion_timeout_s`` (every thread is in a slow call): their lookups
        answer MISS by now, and the slots would stay reserved until a thread
        frees up, for as long as a hung tier holds them all."""
        for job in self._pool.take_unstarted_promotions(now - self.promotion_timeout_s):
            self._stalls.ended(job)
            if job.abandoned:
                self.manager.release_slots(job.slots)
                continue
            self._note_overdue(job)
            for key in job.keys:
                self._inflight.pop(key, None)
            self.manager.complete_reserve(job.keys, success=False)
            self._outcomes.note_failures(job.keys, now)

    def _submit_probes(self) -> None:
        now = time.monotonic()
        for low in self.lower:
            if low.probes is None:
                continue
            keys = low.probes.take_batch()
            if not keys:
                continue
            if self._pool.submit(ProbeJob(low.tier, keys)):
                self._probes_in_flight += 1
                self.counters["probes"] += len(keys)
            else:
                low.probes.answer(keys, [False] * len(keys), now)
                self.counters["probes_deferred"] += len(keys)

    def poll(self) -> None:
        """Apply finished I/O jobs to the manager (scheduler thread only)."""
        if not self._pool.has_done():
            return
        for job in self._pool.take_done():
            self._apply(job)

    def _apply(self, job: Job) -> None:
        if not isinstance(job, ProbeJob):
            busy = self._busy["read" if isinstance(job, PromotionJob) else "write"]
            for name, seconds in job.busy.items():
                busy[name] = busy.get(name, 0.0) + seconds
        if isinstance(job, PromotionJob):
            self._stalls.ended(job)
            if job.abandoned:
                self.manager.release_slots(job.slots)
            else:
                self._finish_promotion(job)
        elif isinstance(job, ProbeJob):
            self._probes_in_flight -= 1
            low = next(low for low in self.lower if low.tier is job.tier)
            if low.probes is not None:  # aged from when the tier answered, not from now
                low.probes.answer(job.keys, job.found or [False] * len(job.keys),
                                  job.answered or time.monotonic())
        else:
            self._writes.finish(job)
            self._forget_probes(job)

    def _forget_probes(self, job: WriteJob) -> None:
        """Drop the probe answers of the keys ``job`` wrote to remote tiers: a
        "not there" asked before this write would hide the block for up to
        ``probe_ttl_s`` (a block the CPU tier evicts soon after its first
        lookup, as write-on-evict does to every block). The next lookup asks
        again."""
        for low in self.lower:
            if low.probes is not None and any(t is low.tier for t in job.tiers):
                for key in job.keys:
                    low.probes.forget(key)

    def _abandon_jobs(self) -> list[int]:
        """Mark every unapplied promotion and write job abandoned; return the
        slots they may still use."""
        jobs = {id(job): job for job in self._inflight.values()}
        self._inflight.clear()
        slots: list[int] = []
        for job in jobs.values():
            job.abandoned = True
            slots += job.slots
        return slots + self._writes.abandon()

    def _note_overdue(self, job: PromotionJob) -> None:
        """Count ``job``'s blocks in ``promotion_timeouts`` once: when a lookup
        first gives up on it, or when it finishes past the timeout."""
        if not job.overdue:
            job.overdue = True
            self.counters["promotion_timeouts"] += len(job.keys)

    def _finish_promotion(self, job: PromotionJob) -> None:
        if time.monotonic() - job.started > self.promotion_timeout_s:
            self._note_overdue(job)
        ok = job.ok or [False] * len(job.keys)
        good = [k for k, done in zip(job.keys, ok, strict=True) if done]
        bad = [k for k, done in zip(job.keys, ok, strict=True) if not done]
        for key in job.keys:
            self._inflight.pop(key, None)
        self.manager.complete_reserve(good, success=True)
        for key, source in zip(job.keys, job.source or [""] * len(job.keys), strict=True):
            if not source:
                continue
            self._outcomes.note_source(key, source)
            self._writes.note_promoted(key, source)
        if not bad:
            return
        self.manager.complete_reserve(bad, success=False)
        self.counters["promotion_failures"] += len(bad)
        self._outcomes.note_failures(bad, time.monotonic())

    # ------------------------------------------------------------ stores
    def prepare_store(
        self, keys: Iterable[bytes], ctx: RequestContext
    ) -> PrepareStoreOutput | None:
        """``manager.prepare_store``, counting the offer as a use of each key."""
        keys = list(keys)
        self.manager.bind(ctx)  # a context a reset outlived counts anew
        self._writes.note_uses(keys, ctx)
        return self.manager.prepare_store(keys, ctx)

    def complete_store(
        self, keys: Iterable[bytes], ctx: RequestContext, success: bool = True
    ) -> None:
        """``manager.complete_store``, then write-through of the admitted blocks."""
        keys = list(keys)
        self.manager.complete_store(keys, ctx, success=success)
        if success:
            self._writes.write_through(keys)
        self._writes.submit_due()

    def on_request_finished(self, ctx: RequestContext) -> None:
        """Submit writes the request made due, then ``manager.on_request_finished``."""
        self._writes.submit_due()
        self.manager.on_request_finished(ctx)

    def write_through(self, keys: Iterable[bytes]) -> None:
        """Write READY ``keys`` to every store tier now (admission applies)."""
        self._writes.write_through(list(keys))

    # ------------------------------------------------------------ whole cascade
    def take_events(self) -> list[Event]:
        """The lower tiers' pending ``stored`` / ``removed`` events (medium: the
        tier's name upper-cased, e.g. ``DISK``)."""
        out: list[Event] = []
        for tier in self.tiers:
            try:
                events = tier.take_events()
            except Exception as exc:
                self._warn.warning("kvtier cascade: %s events failed: %s", tier.name, exc)
                continue
            out.extend(e for e in (ev.as_event() for ev in events) if e is not None)
        return out

    def busy(self) -> bool:
        """Whether any job is batched, queued or running (also a promotion a
        reset abandoned: its slots are held back until it is applied)."""
        return bool(self._inflight or self._stalls or self._probes_in_flight
                    or self._writes.busy())

    def drain(self, timeout_s: float = 30.0) -> bool:
        """End steps until every submitted job finished and was applied; False
        on timeout."""
        deadline = time.monotonic() + timeout_s
        self.on_schedule_end()
        while self.busy():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
            self.on_schedule_end()
        return True

    def reset(self, timeout_s: float = RESET_WAIT_S, *, owed_completions: bool = True) -> None:
        """Let in-flight jobs finish, then ``manager.reset(owed_completions=...)``
        and forget failed keys, probe answers and use counts.

        Jobs still running after ``timeout_s`` are abandoned: the slots they
        read or write are held back from the manager until each is applied
        (never handed to another block under them), and their results dropped
        (a write still lands whole in its tier: its slot kept its bytes).
        """
        busy: list[int] = []
        if not self.drain(timeout_s):
            busy = self._abandon_jobs()
            logger.warning("kvtier cascade: reset with I/O jobs still running; %d slot(s) "
                           "held back until they end", len(busy))
        self.manager.reset(owed_completions=owed_completions, busy_slots=busy)
        self._outcomes.clear()
        self._writes.clear()
        for low in self.lower:
            if low.probes is not None:
                low.probes.clear()

    def stats(self) -> dict[str, int]:
        queued_reads, queued_writes = self._pool.queued()
        return {
            **self.counters,
            "promotions_in_flight": len(self._inflight),
            "writes_in_flight": self._writes.pending,
            "queued_promotions": queued_reads,
            "queued_writes": queued_writes,
            "failed_keys": len(self._outcomes.failed),
        }

    def debug_state(self) -> dict[str, Any]:
        """Entries of every structure the cascade keeps, cheap (``len`` of each),
        with their bounds: ``uses`` <= ``max_tracker_size``; ``due``,
        ``in_flight_promotions`` and ``batched_promotions`` <= the manager's
        ``num_blocks``; ``failed`` and ``sources`` <= ``max_failed``;
        ``evicted_jobs`` (this step's write-on-evict copies) <= ``max_queue``;
        ``writes_in_flight``, ``probe_jobs`` and ``running_promotions`` (jobs,
        with those a reset abandoned until they end) <= the I/O pool's jobs, which
        are ``queued_reads`` / ``queued_writes`` <= ``max_queue`` each and
        ``done`` <= ``2 * (2 * max_queue + io_threads)``; ``probes.<tier>``: each
        remote tier's ``ExistenceProbes`` (``known`` <= ``max_probes``);
        ``tiers.<tier>``: each tier's ``debug_state()``."""
        state: dict[str, Any] = {
            **self._writes.sizes(),
            "batched_promotions": sum(len(job.keys) for job in self._batching.values()),
            "in_flight_promotions": len(self._inflight),
            "running_promotions": len(self._stalls),
            "failed": len(self._outcomes.failed),
            "sources": len(self._outcomes.sources),
            "probe_jobs": self._probes_in_flight,
            **self._pool.sizes(),
        }
        state["probes"] = {low.tier.name: low.probes.sizes()
                           for low in self.lower if low.probes is not None}
        tiers: dict[str, dict[str, int]] = {}
        for tier in self.tiers:
            try:
                tiers[tier.name] = tier.debug_state()
            except Exception as exc:
                self._warn.warning("kvtier cascade: %s debug_state failed: %s", tier.name, exc)
        state["tiers"] = tiers
        return state

    def tier_stats(self) -> dict[str, dict[str, object]]:
        """Each lower tier's ``stats()`` plus ``available`` (``Tier.serving``:
        the gauge reads 0 from a breaker's opening until a probe succeeds) and
        ``read_ms`` / ``write_ms`` (milliseconds I/O threads spent in its reads
        and writes), by tier name."""
        out: dict[str, dict[str, object]] = {}
        for tier in self.tiers:
            try:
                out[tier.name] = {**tier.stats(), "available": _is_serving(tier),
                                  "read_ms": int(self._busy["read"].get(tier.name, 0.0) * 1000),
                                  "write_ms": int(self._busy["write"].get(tier.name, 0.0) * 1000)}
            except Exception as exc:
                self._warn.warning("kvtier cascade: %s stats failed: %s", tier.name, exc)
                out[tier.name] = {"available": _is_serving(tier)}  # the gauge stays current
        return out

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the I/O threads and close the owned tiers, in bounded time.

        No tier call starts once shutdown has begun: queued writes, this
        step's write-on-evict copies and the blocks of running writes not yet
        handed to a tier are dropped (``dropped_writes``), batched and queued
        promotions give their slots back unread. The calls already running
        get ``SHUTDOWN_GRACE_S`` (at most ``timeout_s``) to end; then owned
        tiers are closed, which ends a Redis call at once (a failed write),
        and the threads are joined for the rest of ``timeout_s`` (one stuck
        in a call that close does not end, a hung disk, is left behind: a
        daemon). So a dead or stopped Redis costs a shutdown about
        ``SHUTDOWN_GRACE_S``, and no shutdown takes more than ``timeout_s``.
        Later calls do nothing."""
        if self._shut:
            return
        self._shut = True
        deadline = time.monotonic() + timeout_s
        dropped = self._pool.stop()
        self._submit_promotions()  # refused now: their reservations are given back
        self._writes.drop_evicted()
        self._pool.join(min(timeout_s, SHUTDOWN_GRACE_S))
        if self._own_tiers:
            for tier in self.tiers:
                try:
                    tier.close()
                except Exception as exc:
                    logger.warning("kvtier cascade: closing %s: %s", tier.name, exc)
        self._pool.join(max(0.0, deadline - time.monotonic()))
        for job in dropped:
            job.written = job.skipped = job.failed = 0
            job.dropped = len(job.keys)
            self._apply(job)
        self.poll()
        if self._writes.evicts:
            self.manager.set_eviction_listener(None)
        self._close_own_region()

    def _close_own_region(self) -> None:
        """Unmap the region this cascade attached (vLLM's scheduler: its
        mapping of the workers' region) now, not at a later garbage
        collection: the workers unlink the file, and tmpfs frees its pages,
        ``cpu_bytes_to_use`` of memory, only with the last mapping. A thread
        left in a hung tier keeps its slot's view, and so the mapping, until
        it returns (never an unmapped slot)."""
        if not callable(self._region_source) or self._region is None:
            return
        close = getattr(self._region, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception as exc:
            logger.warning("kvtier cascade: closing the slot region: %s", exc)


def _is_serving(tier: Tier) -> bool:
    """``tier.serving``; False when asking raises."""
    try:
        return bool(tier.serving)
    except Exception:
        return False


def lower_tiers(
    tiers: list[Tier],
    write_policy: WritePolicy | Sequence[WritePolicy],
    store_threshold: int | Sequence[int],
    probes: tuple[float, float, int] | None,
) -> list[LowerTier]:
    """Each tier with its checked settings; ``probes`` (ttl, timeout, max keys)
    gives remote tiers asynchronous existence probes (None: synchronous)."""
    policies = _per_tier("write_policy", write_policy, len(tiers))
    thresholds = _per_tier("store_threshold", store_threshold, len(tiers))
    if any(p not in WRITE_POLICIES for p in policies):
        raise ValueError(f"write_policy must be 'store' or 'evict' (per tier), "
                         f"got {write_policy!r}")
    for t in thresholds:
        _check_int("store_threshold", t)
    return [
        LowerTier(tier, policy, threshold,
                  ExistenceProbes(*probes) if probes is not None and tier.remote else None)
        for tier, policy, threshold in zip(tiers, policies, thresholds, strict=True)
    ]


def _per_tier(name: str, value: object, n: int) -> list:
    """``value`` for each of ``n`` tiers: one value for all, or a sequence of ``n``."""
    if isinstance(value, (str, int)):
        return [value] * n
    if not isinstance(value, Sequence):
        raise ValueError(f"{name} must be one value or one per tier ({n}), got {value!r}")
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name} must be one value or one per tier ({n}), got {value!r}")
    return values


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _holds(tier: Tier, key: bytes) -> bool:
    try:
        return bool(tier.contains([key])[0])
    except Exception as exc:
        logger.debug("kvtier cascade: %s contains failed: %s", tier.name, exc)
        return False
