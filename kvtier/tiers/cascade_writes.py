"""The tier cascade's writes: which CPU-tier blocks each lower tier gets, and when.

Stores land in the CPU tier; each lower tier has a write policy and an
admission threshold. A block is *used* by a request that hits it or offers
it for storing; each request counts once per block (:class:`BlockUses`,
``max_tracker_size`` blocks, only kept when some threshold is above 1). A tier
with threshold ``t`` receives a block only once ``t`` requests used it (``t =
2``: no SSD write for one-off prompts).

A ``"store"`` tier is written through: on ``complete_store`` (blocks already
admitted), when a resident block reaches ``t`` uses, and when a block promoted
from another tier completes; the job's keys are pinned with
``manager.pin_internal`` (not a request access, recency is unchanged) until
the cascade's ``poll`` applies the finished job. Writes of a request's stores
are submitted before ``complete_store`` returns, so always before the
request's finish.

An ``"evict"`` tier receives admitted blocks as the CPU tier evicts them: the
manager's eviction listener copies each victim's slot (on the scheduler
thread, before the slot is handed out again) into a job owning the copy,
queued at the step's end after the step's promotions (a write that makes a
tier evict must not remove a block about to be read; with several I/O threads
this is likely, not certain, and a lost race is a failed promotion, i.e. a
miss).

Either way the job asks each tier which keys it holds already and ``put``s
only the others (no duplicate writes); each tier applies its own capacity and
eviction (``DiskTier``: LRU within ``capacity_bytes``; Redis: TTL and the
server's ``maxmemory-policy``). ``writes_not_admitted`` counts refusals (a
block refused at store and again at eviction counts twice); a write the I/O
queue cannot take, or with no region or no available tier, is dropped
(``dropped_writes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.manager import OffloadManager
from kvtier.request import RequestContext
from kvtier.tiers.base import Tier
from kvtier.tiers.io_pool import IOPool, SlotSource, WriteJob
from kvtier.tiers.lower_tier import LowerTier
from kvtier.tiers.uses import BlockUses


class CascadeWrites:
    """The write side of a :class:`~kvtier.tiers.cascade.TierCascade` (module doc).

    Owns, all on the scheduler thread:

    * ``uses``: the per-block use counts (:class:`BlockUses`, at most
      ``max_tracker_size`` blocks);
    * ``due``: resident keys to offer the store tiers again (at most the
      manager's ``num_blocks``: each is a resident block);
    * ``evicted``: this step's write-on-evict jobs, at most the pool's
      ``max_queue`` (more are dropped);
    * ``running``: write jobs submitted and not yet applied by :meth:`finish`
      (by ``id``; at most the pool's queued and running jobs).

    Shares with the cascade: the manager (pins and readiness), the I/O pool,
    the lower tiers, the region source and the cascade's ``counters`` dict,
    where it counts ``cascade_writes``, ``duplicate_writes_skipped``,
    ``write_failures``, ``dropped_writes`` and ``writes_not_admitted``.
    """

    __slots__ = ("manager", "lower", "pool", "region", "counters", "uses", "due", "evicted",
                 "running", "_store_tier_names")

    def __init__(self, manager: OffloadManager, lower: Sequence[LowerTier], pool: IOPool,
                 region: Callable[[], SlotSource | None], counters: dict[str, int],
                 max_tracker_size: int) -> None:
        self.manager = manager
        self.lower = list(lower)
        self.pool = pool
        self.region = region
        self.counters = counters
        self.uses = BlockUses([low.threshold for low in self.lower], max_tracker_size,
                              watched=[low.threshold for low in self.lower
                                       if low.write == "store"])
        self.due: dict[bytes, None] = {}
        self.evicted: list[WriteJob] = []
        self.running: dict[int, WriteJob] = {}
        self._store_tier_names = [low.tier.name for low in self.lower if low.write == "store"]

    @property
    def evicts(self) -> bool:
        """Whether some tier is written on eviction (the manager's listener is needed)."""
        return any(low.write == "evict" for low in self.lower)

    @property
    def pending(self) -> int:
        """Write jobs submitted and not yet applied."""
        return len(self.running)

    def busy(self) -> bool:
        """Whether a write is due, batched or running."""
        return bool(self.running or self.due or self.evicted)

    def sizes(self) -> dict[str, int]:
        """Entries of each structure (bounds in the class docstring)."""
        return {"uses": len(self.uses), "due": len(self.due),
                "evicted_jobs": len(self.evicted), "writes_in_flight": self.pending}

    # ------------------------------------------------------------ admission
    def note_uses(self, keys: list[bytes], ctx: RequestContext) -> None:
        """Count a use of ``keys`` by ``ctx``; a resident key reaching a store
        tier's threshold becomes due (a key still being promoted becomes due
        when its promotion completes)."""
        if not self.uses.counting:
            return
        ready = self.manager._is_ready
        for key in self.uses.record(keys, ctx):
            if ready(key):
                self.due[key] = None

    def note_promoted(self, key: bytes, source: str) -> None:
        """``key`` came up from tier ``source``: the other store tiers may want it."""
        if any(name != source for name in self._store_tier_names):
            self.due[key] = None

    # ------------------------------------------------------------ write-through
    def submit_due(self) -> None:
        """Write the due keys through (their refusals were counted before)."""
        if self.due:
            due, self.due = list(self.due), {}
            self.write_through(due, count_refusals=False)

    def write_through(self, keys: list[bytes], count_refusals: bool = True) -> None:
        """One write job per distinct set of admitted READY keys over the store
        tiers (a tier holding a key already skips it in the job)."""
        ready = self.manager._is_ready
        keys = [k for k in dict.fromkeys(keys) if ready(k)]
        if not keys:
            return
        groups: dict[tuple[bytes, ...], list[Tier]] = {}
        for low in self.lower:
            if low.write != "store":
                continue
            admitted = self.uses.admitted(low.threshold, keys)
            if count_refusals:
                self.counters["writes_not_admitted"] += len(keys) - len(admitted)
            if admitted:
                groups.setdefault(tuple(admitted), []).append(low.tier)
        for group, tiers in groups.items():
            self._submit(list(group), tiers)

    def _submit(self, keys: list[bytes], tiers: list[Tier]) -> None:
        """Pin ``keys`` and queue their write to ``tiers``, or count it dropped."""
        if self.region() is None or not any(t.available for t in tiers):
            self.counters["dropped_writes"] += len(keys)
            return
        slots = self.manager.pin_internal(keys)
        if not self._queue(WriteJob(keys, slots, tiers)):
            self.manager.unpin_internal(keys)

    def _queue(self, job: WriteJob) -> bool:
        if not self.pool.submit(job):
            self.counters["dropped_writes"] += len(job.keys)
            return False
        self.running[id(job)] = job
        return True

    # ------------------------------------------------------------ write-on-evict
    def on_evict(self, keys: list[bytes], slots: list[int]) -> None:
        """The manager's eviction listener: copy admitted victims for the evict tiers."""
        region = self.region()
        for low in self.lower:
            if low.write != "evict":
                continue
            admitted = set(self.uses.admitted(low.threshold, keys))
            self.counters["writes_not_admitted"] += len(keys) - len(admitted)
            picked = [(k, s) for k, s in zip(keys, slots, strict=True) if k in admitted]
            if not picked:
                continue
            if (region is None or not low.tier.available
                    or len(self.evicted) >= self.pool.max_queue):
                self.counters["dropped_writes"] += len(picked)
                continue
            copies = [region.slot_array(s).copy() for _, s in picked]
            self.evicted.append(
                WriteJob([k for k, _ in picked], [s for _, s in picked], [low.tier], copies))

    def submit_evicted(self) -> None:
        """Queue the step's write-on-evict copies (after its promotions)."""
        jobs, self.evicted = self.evicted, []
        for job in jobs:
            self._queue(job)

    def drop_evicted(self) -> None:
        """Forget the step's write-on-evict copies, counted as dropped (shutdown)."""
        for job in self.evicted:
            self.counters["dropped_writes"] += len(job.keys)
        self.evicted = []

    # ------------------------------------------------------------ results
    def finish(self, job: WriteJob) -> None:
        """Apply a finished write job: unpin (or, abandoned by a reset, give
        its held-back slots back), count."""
        self.running.pop(id(job), None)
        if job.copies is None:
            if job.abandoned:
                self.manager.release_slots(job.slots)
            else:
                self.manager.unpin_internal(job.keys)
        self.counters["cascade_writes"] += job.written
        self.counters["duplicate_writes_skipped"] += job.skipped
        self.counters["write_failures"] += job.failed
        self.counters["dropped_writes"] += job.dropped

    def abandon(self) -> list[int]:
        """Mark the running jobs abandoned (a reset that could not wait for
        them); return the slots they may still read."""
        slots: list[int] = []
        for job in self.running.values():
            if job.abandoned:  # by an earlier reset: its slots are held back already
                continue
            job.abandoned = True
            if job.copies is None:
                slots += job.slots
        return slots

    def clear(self) -> None:
        """Forget the use counts (the cascade's reset, after its drain)."""
        self.uses.clear()
