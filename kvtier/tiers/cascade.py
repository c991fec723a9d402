"""The scheduler-side tier cascade: CPU slots -> disk -> Redis (DESIGN.md §7).

``TierCascade`` wraps one :class:`~kvtier.manager.OffloadManager` (the CPU
tier's metadata), the CPU slot region (the bytes) and a list of lower tiers,
fastest first. All manager calls happen on the caller's (scheduler) thread;
I/O threads only move bytes between slots and tiers and report back through a
queue that :meth:`TierCascade.poll` applies.

Lookup walks CPU -> tiers. A lower-tier hit reserves a CPU slot
(``manager.reserve``) and submits a promotion job; the key reports
HIT_PENDING until :meth:`poll` sees the job done, then it is an ordinary CPU
hit. A key already being promoted starts no second job. A failed promotion
(miss at read time, checksum mismatch, short payload, I/O error) frees the slot
and the key is a MISS for ``failure_ttl_s`` (a bounded set), so it is not
retried in a loop; a promotion running past ``promotion_timeout_s`` reports
MISS at once and frees its slot when the thread returns (the bytes of a slot
still being written are never handed out).

Stores land in the CPU tier; each lower tier has its write policy. A
``"store"`` tier is written through: each successful ``complete_store`` submits
one write job per batch, its keys pinned with ``manager.pin_internal`` (not a
request access, recency is unchanged) until ``poll`` sees the job done; these
writes are submitted inside ``complete_store``, so always before the request's
finish. An ``"evict"`` tier receives blocks as the CPU tier evicts them: the
manager's eviction listener copies each victim's slot (on the scheduler thread,
before the slot is handed out again) into a job that owns the copy. Either
way the job asks each tier which keys it holds already and ``put``s only the
others (no duplicate writes); each tier applies its own capacity, eviction
and admission (``DiskTier``'s ``capacity_bytes``, Redis' ``maxmemory``).

Both queues are bounded (``max_queue`` jobs each) and the I/O threads take
promotions first: under backpressure stores are dropped (``dropped_writes``)
and promotions are not started (the lookup is a MISS, ``promotions_deferred``)
rather than queued without bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvtier.manager import OffloadManager
from kvtier.request import RequestContext
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers.base import Tier, WarningLimiter

logger = logging.getLogger(__name__)

WritePolicy = Literal["store", "evict"]
RegionSource = SlotRegion | Callable[[], SlotRegion | None]


@dataclass(slots=True)
class _Promotion:
    key: bytes
    slot: int
    tiers: list[Tier]
    started: float
    ok: bool = False
    tier_name: str = ""


@dataclass(slots=True)
class _Write:
    keys: list[bytes]
    slots: list[int]
    tiers: list[Tier]
    copies: list[np.ndarray] | None = None  # owned bytes (evictions); None: pinned slots
    written: int = 0
    skipped: int = 0
    failed: int = 0


class TierCascade:
    """CPU -> lower tiers; see the module docstring.

    Parameters:
        manager: the CPU tier's manager; only this object calls it afterwards
            (from one thread).
        region: the slot region, or a callable returning it (None while it is
            not available yet: lookups fall back to the CPU tier, writes are
            dropped).
        tiers: lower tiers, fastest first (disk, then Redis).
        write_policy: ``"store"`` (write-through on ``complete_store``) or
            ``"evict"`` (write on CPU eviction), for every tier or one per tier.
        io_threads: I/O threads shared by promotions and writes.
        max_queue: queued jobs per kind (promotions, writes).
        failure_ttl_s / max_failed: how long, and for how many keys, a failed
            promotion is remembered as a miss.
        promotion_timeout_s: a promotion running longer is reported as a miss.
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
        failure_ttl_s: float = 10.0,
        max_failed: int = 10_000,
        promotion_timeout_s: float = 30.0,
        own_tiers: bool = True,
    ) -> None:
        policies = (
            [write_policy] * len(tiers) if isinstance(write_policy, str) else list(write_policy)
        )
        if len(policies) != len(tiers) or any(p not in ("store", "evict") for p in policies):
            raise ValueError(
                f"write_policy must be 'store' or 'evict', or one of them per tier "
                f"({len(tiers)}), got {write_policy!r}"
            )
        for name, value in (("io_threads", io_threads), ("max_queue", max_queue),
                            ("max_failed", max_failed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.manager = manager
        self.tiers = list(tiers)
        self.write_policies: list[WritePolicy] = policies
        self._store_tiers = [t for t, p in zip(self.tiers, policies, strict=True) if p == "store"]
        self._evict_tiers = [t for t, p in zip(self.tiers, policies, strict=True) if p == "evict"]
        self.max_queue = max_queue
        self.failure_ttl_s = float(failure_ttl_s)
        self.max_failed = max_failed
        self.promotion_timeout_s = float(promotion_timeout_s)
        self._own_tiers = own_tiers
        self._region_source = region
        self._region: SlotRegion | None = region if isinstance(region, SlotRegion) else None
        self._warn = WarningLimiter(logger)

        self._cond = threading.Condition()
        self._loads: deque[_Promotion] = deque()
        self._writes: deque[_Write] = deque()
        self._done: deque[_Promotion | _Write] = deque()  # appended by I/O threads
        self._stopping = False

        # Scheduler-thread state.
        self._inflight: dict[bytes, _Promotion] = {}
        self._failed: OrderedDict[bytes, float] = OrderedDict()  # key -> retry-after time
        self._pending_writes = 0
        self.counters = dict.fromkeys(
            (
                "promotions", "promotion_failures", "promotion_timeouts",
                "promotions_deferred", "cascade_writes", "duplicate_writes_skipped",
                "write_failures", "dropped_writes",
            ),
            0,
        )
        self._threads = [
            threading.Thread(target=self._run, name=f"kvtier-io-{i}", daemon=True)
            for i in range(io_threads)
        ]
        for thread in self._threads:
            thread.start()
        if self._evict_tiers:
            manager.set_eviction_listener(self._on_evict)

    # ------------------------------------------------------------ region
    def region(self) -> SlotRegion | None:
        """The slot region, resolving a lazy source on first success."""
        if self._region is None and not isinstance(self._region_source, SlotRegion):
            try:
                self._region = self._region_source()
            except Exception as exc:
                self._warn.warning("kvtier cascade: slot region not available: %s", exc)
        return self._region

    # ------------------------------------------------------------ lookups
    def lookup_one(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """CPU first, then the lower tiers (promoting a hit); see the module docstring."""
        self.poll()
        job = self._inflight.get(key)
        if job is not None:
            if time.monotonic() - job.started > self.promotion_timeout_s:
                return LookupResult.MISS
            return LookupResult.HIT_PENDING
        result = self.manager.lookup_one(key, ctx)
        if result is not LookupResult.MISS or not self.tiers or key in self.manager._slot:
            return result  # resident but refused (lease budget): not a tier's business
        if self._recently_failed(key):
            return LookupResult.MISS
        return self._try_promote(key)

    def _recently_failed(self, key: bytes) -> bool:
        until = self._failed.get(key)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._failed[key]
        return False

    def _try_promote(self, key: bytes) -> LookupResult:
        holders = [t for t in self.tiers if t.available and _holds(t, key)]
        if not holders:
            return LookupResult.MISS
        region = self.region()
        if region is None:
            return LookupResult.MISS
        with self._cond:
            full = len(self._loads) >= self.max_queue
        if full:
            self.counters["promotions_deferred"] += 1
            return LookupResult.MISS
        slots = self.manager.reserve([key])
        if slots is None:
            return LookupResult.MISS
        job = _Promotion(key, slots[0], holders, time.monotonic())
        self._inflight[key] = job
        self.counters["promotions"] += 1
        with self._cond:
            self._loads.append(job)
            self._cond.notify()
        return LookupResult.HIT_PENDING

    def poll(self) -> None:
        """Apply finished I/O jobs to the manager (scheduler thread only)."""
        done = self._done
        while done:
            job = done.popleft()
            if isinstance(job, _Promotion):
                self._finish_promotion(job)
            else:
                self._finish_write(job)

    def _finish_promotion(self, job: _Promotion) -> None:
        self._inflight.pop(job.key, None)
        self.manager.complete_reserve([job.key], success=job.ok)
        if job.ok:
            return
        self.counters["promotion_failures"] += 1
        if time.monotonic() - job.started > self.promotion_timeout_s:
            self.counters["promotion_timeouts"] += 1
        failed = self._failed
        failed[job.key] = time.monotonic() + self.failure_ttl_s
        failed.move_to_end(job.key)
        while len(failed) > self.max_failed:
            failed.popitem(last=False)

    def _finish_write(self, job: _Write) -> None:
        self._pending_writes -= 1
        if job.copies is None:
            self.manager.unpin_internal(job.keys)
        self.counters["cascade_writes"] += job.written
        self.counters["duplicate_writes_skipped"] += job.skipped
        self.counters["write_failures"] += job.failed

    # ------------------------------------------------------------ stores
    def complete_store(
        self, keys: Iterable[bytes], ctx: RequestContext, success: bool = True
    ) -> None:
        """``manager.complete_store``, then write-through of the stored blocks."""
        keys = list(keys)
        self.manager.complete_store(keys, ctx, success=success)
        if success and self._store_tiers:
            self.write_through(keys)

    def write_through(self, keys: Iterable[bytes]) -> bool:
        """Submit one write job for the READY ``keys``; False when it was dropped."""
        ready = self.manager._is_ready
        keys = [k for k in dict.fromkeys(keys) if ready(k)]
        if not keys:
            return True
        if not self._can_write(self._store_tiers, len(keys)):
            return False
        slots = self.manager.pin_internal(keys)
        self._submit_write(_Write(keys, slots, self._store_tiers))
        return True

    def _on_evict(self, keys: list[bytes], slots: list[int]) -> None:
        """The manager's eviction listener: copy the victims out for the evict tiers."""
        if not self._can_write(self._evict_tiers, len(keys)):
            return
        region = self._region
        assert region is not None  # _can_write resolved it
        copies = [region.slot_array(s).copy() for s in slots]
        self._submit_write(_Write(list(keys), list(slots), self._evict_tiers, copies))

    def _can_write(self, tiers: list[Tier], n: int) -> bool:
        """Whether a write job for ``n`` keys can be queued now; counts a drop if not."""
        ok = self.region() is not None and any(t.available for t in tiers)
        if ok:
            with self._cond:
                ok = len(self._writes) < self.max_queue and not self._stopping
        if not ok:
            self.counters["dropped_writes"] += n
        return ok

    def _submit_write(self, job: _Write) -> None:
        self._pending_writes += 1
        with self._cond:
            self._writes.append(job)
            self._cond.notify()

    def on_schedule_end(self) -> None:
        self.poll()

    # ------------------------------------------------------------ I/O threads
    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._loads and not self._writes and not self._stopping:
                    cond.wait()
                if self._loads:
                    job: _Promotion | _Write = self._loads.popleft()
                elif self._writes:
                    job = self._writes.popleft()
                else:
                    return
            try:
                if isinstance(job, _Promotion):
                    self._promote(job)
                else:
                    self._write(job)
            except Exception as exc:
                self._warn.warning("kvtier cascade: I/O job failed: %s", exc)
            self._done.append(job)

    def _promote(self, job: _Promotion) -> None:
        region = self._region
        if region is None:
            return
        buf = region.slot_array(job.slot)
        for tier in job.tiers:
            if not tier.available:
                continue
            try:
                n = tier.get_into([job.key], [buf])[0]
            except Exception as exc:
                self._warn.warning("kvtier cascade: %s read failed: %s", tier.name, exc)
                continue
            if n == buf.nbytes:
                job.ok, job.tier_name = True, tier.name
                return
            if n is not None:
                self._warn.warning(
                    "kvtier cascade: %s block of %d bytes for a %d-byte slot; ignored",
                    tier.name, n, buf.nbytes,
                )

    def _write(self, job: _Write) -> None:
        region = self._region
        if region is None:
            return
        sources = job.copies or [region.slot_array(s) for s in job.slots]
        for tier in job.tiers:
            if not tier.available:
                job.failed += len(job.keys)
                continue
            try:
                held = tier.contains(job.keys)
                items = [
                    (k, buf) for k, buf, h in zip(job.keys, sources, held, strict=True) if not h
                ]
                job.skipped += len(job.keys) - len(items)
                if items:
                    results = tier.put(items)
                    ok = sum(1 for r in results if r)
                    job.written += ok
                    job.failed += len(items) - ok
            except Exception as exc:
                job.failed += len(job.keys)
                self._warn.warning("kvtier cascade: %s write failed: %s", tier.name, exc)

    # ------------------------------------------------------------ whole cascade
    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted job finished and was applied; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._inflight or self._pending_writes:
            self.poll()
            if not (self._inflight or self._pending_writes):
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def reset(self, timeout_s: float = 30.0) -> None:
        """Let in-flight jobs finish (their slots must not be reused under them), then
        ``manager.reset()`` and forget the failed keys."""
        if not self.drain(timeout_s):
            logger.warning("kvtier cascade: reset with I/O jobs still running")
        self.manager.reset()
        self._failed.clear()

    def stats(self) -> dict[str, int]:
        with self._cond:
            queued_loads, queued_writes = len(self._loads), len(self._writes)
        return {
            **self.counters,
            "promotions_in_flight": len(self._inflight),
            "writes_in_flight": self._pending_writes,
            "queued_promotions": queued_loads,
            "queued_writes": queued_writes,
            "failed_keys": len(self._failed),
        }

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Drop queued writes, finish running jobs, join the threads, close owned tiers."""
        with self._cond:
            self._stopping = True
            dropped = list(self._writes)
            self._writes.clear()
            self._cond.notify_all()
        for job in dropped:
            self.counters["dropped_writes"] += len(job.keys)
            self._done.append(job)
        for thread in self._threads:
            thread.join(timeout_s)
        self.poll()
        if self._evict_tiers:
            self.manager.set_eviction_listener(None)
        if self._own_tiers:
            for tier in self.tiers:
                try:
                    tier.close()
                except Exception as exc:
                    logger.warning("kvtier cascade: closing %s: %s", tier.name, exc)


def _holds(tier: Tier, key: bytes) -> bool:
    try:
        return bool(tier.contains([key])[0])
    except Exception as exc:
        logger.debug("kvtier cascade: %s contains failed: %s", tier.name, exc)
        return False
