"""The tier cascade's I/O threads and the jobs they run.

Three kinds of job move between the scheduler thread and the pool:

* :class:`PromotionJob`: read blocks from a lower tier into reserved CPU slots;
* :class:`ProbeJob`: ask a remote tier which keys it holds (one batch);
* :class:`WriteJob`: copy CPU slots (or owned copies of evicted slots) to tiers.

A job is built and later applied on the scheduler thread; only its ``run``
executes on an I/O thread, filling the job's result fields. The pool takes
promotions and probes before writes, and both queues are bounded, so under
backpressure writes are refused first (the caller counts them as dropped).

Shutdown (:meth:`IOPool.stop`) sets an event every running job checks
before each tier call: a job starts no tier call after it (a write counts
its remaining blocks in ``WriteJob.dropped``, a promotion leaves them
unread), so a stop waits for the calls already running, never for new ones
to a tier that may be dead.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.tiers.base import Tier, WarningLimiter
from kvtier.tiers.gil_handoff import quick_handoffs

logger = logging.getLogger(__name__)
_warn = WarningLimiter(logger)


class SlotSource(Protocol):
    """Where the CPU tier's block bytes are: a ``SlotRegion`` (one array per
    slot) or ``RankRegions`` (one ``ShardedSlot`` per slot, tensor parallel)."""

    def slot_array(self, slot_id: int, /) -> Any: ...


@dataclass(slots=True)
class PromotionJob:
    """Blocks to read into reserved slots; each tier of ``tiers`` is tried in
    order for the keys still missing. ``ok[i]`` / ``source[i]``: result per key;
    ``busy``: seconds spent in each tier's reads, by tier name; ``overdue``:
    set once the job has run past the cascade's ``promotion_timeout_s``;
    ``abandoned``: set by a reset that could not wait for it (its slots are
    held back until it is applied, and its result is dropped); ``reading``:
    (tier, monotonic start) of the read running now, set by the I/O thread
    (one assignment, so a reader on another thread sees a whole pair)."""

    keys: list[bytes]
    slots: list[int]
    tiers: list[Tier]
    started: float
    ok: list[bool] = field(default_factory=list)
    source: list[str] = field(default_factory=list)
    busy: dict[str, float] = field(default_factory=dict)
    overdue: bool = False
    abandoned: bool = False
    reading: tuple[Tier, float] | None = None

    def run(self, region: SlotSource | None, stop: threading.Event | None = None) -> None:
        """Read the blocks; ``stop`` set (a shutdown): no further tier is asked."""
        self.ok = [False] * len(self.keys)
        self.source = [""] * len(self.keys)
        if region is None:
            return
        buffers = [region.slot_array(s) for s in self.slots]
        for tier in self.tiers:
            todo = [i for i, done in enumerate(self.ok) if not done]
            if not todo or _stopped(stop):
                return
            if not tier.available:
                continue
            t0 = time.perf_counter()
            self.reading = (tier, time.monotonic())
            try:
                sizes = tier.get_into([self.keys[i] for i in todo], [buffers[i] for i in todo])
            except Exception as exc:
                _warn.warning("kvtier cascade: %s read failed: %s", tier.name, exc)
                continue
            finally:
                self.reading = None
                self.busy[tier.name] = self.busy.get(tier.name, 0.0) + time.perf_counter() - t0
            wrong = []
            for i, n in zip(todo, sizes, strict=True):
                if n == buffers[i].nbytes:
                    self.ok[i], self.source[i] = True, tier.name
                elif n is not None:
                    wrong.append(self.keys[i])
                    _warn.warning(
                        "kvtier cascade: %s block of %d bytes for a %d-byte slot; removed",
                        tier.name, n, buffers[i].nbytes,
                    )
            if wrong:
                _remove_wrong_sizes(tier, wrong)


def _remove_wrong_sizes(tier: Tier, keys: list[bytes]) -> None:
    """Delete blocks ``tier`` holds in another size than a slot's: the
    namespace fixes a block's size, so no read of them will ever do, and
    kept, each lookup would find them and promote them in vain."""
    try:
        tier.delete(keys)
    except Exception as exc:
        _warn.warning("kvtier cascade: %s delete failed: %s", tier.name, exc)


@dataclass(slots=True)
class ProbeJob:
    """One batched existence check of ``tier``; ``found`` is None until run,
    all False when the tier failed; ``answered``: when the tier answered
    (monotonic), the age of the answers however late the owner applies them."""

    tier: Tier
    keys: list[bytes]
    found: list[bool] | None = None
    answered: float | None = None

    def run(self, region: SlotSource | None, stop: threading.Event | None = None) -> None:
        """Ask the tier; ``stop`` set (a shutdown): found nothing, not asked."""
        if _stopped(stop):
            self.found = [False] * len(self.keys)
            self.answered = time.monotonic()
            return
        try:
            self.found = [bool(x) for x in self.tier.contains(self.keys)]
        except Exception as exc:
            _warn.warning("kvtier cascade: %s contains failed: %s", self.tier.name, exc)
            self.found = [False] * len(self.keys)
        self.answered = time.monotonic()


@dataclass(slots=True)
class WriteJob:
    """Blocks to copy to ``tiers``: from pinned ``slots``, or from ``copies``
    (owned bytes of evicted slots) when set. Counts per block and tier;
    ``busy``: seconds spent in each tier's calls, by tier name; ``abandoned``:
    as for :class:`PromotionJob` (its pins are gone with the reset);
    ``writing``: (tier, monotonic start) of the tier call running now, set by
    the I/O thread, as ``PromotionJob.reading``; ``dropped``: blocks (per
    tier) not written because the pool stopped first."""

    keys: list[bytes]
    slots: list[int]
    tiers: list[Tier]
    copies: list[Any] | None = None
    written: int = 0
    skipped: int = 0
    failed: int = 0
    dropped: int = 0
    busy: dict[str, float] = field(default_factory=dict)
    abandoned: bool = False
    writing: tuple[Tier, float] | None = None

    def run(self, region: SlotSource | None, stop: threading.Event | None = None) -> None:
        """Write the blocks to each tier; once ``stop`` is set (a shutdown) no
        further tier call starts and the blocks left count in ``dropped``."""
        if self.copies is not None:
            sources: list[Any] = self.copies
        elif region is not None:
            sources = [region.slot_array(s) for s in self.slots]
        else:
            self.failed += len(self.keys) * len(self.tiers)
            return
        for done, tier in enumerate(self.tiers):
            if _stopped(stop):
                self.dropped += len(self.keys) * (len(self.tiers) - done)
                return
            if not tier.available:
                self.failed += len(self.keys)
                continue
            t0 = time.perf_counter()
            self.writing = (tier, time.monotonic())
            try:
                held = tier.contains_waiting(self.keys)
                items = [(k, b) for k, b, h in zip(self.keys, sources, held, strict=True) if not h]
                self.skipped += len(self.keys) - len(items)
                if items and _stopped(stop):  # checked: no put to a tier that may be dead
                    self.dropped += len(items)
                elif items:
                    ok = sum(1 for r in tier.put(items) if r)
                    self.written += ok
                    self.failed += len(items) - ok
            except Exception as exc:
                self.failed += len(self.keys)
                _warn.warning("kvtier cascade: %s write failed: %s", tier.name, exc)
            finally:
                self.writing = None
                self.busy[tier.name] = self.busy.get(tier.name, 0.0) + time.perf_counter() - t0


Job = PromotionJob | ProbeJob | WriteJob


def _stopped(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


class _Shared:
    """What the I/O threads share with their :class:`IOPool`: the queues, the
    condition guarding them, the stop event and the region. The threads hold
    this, not the pool, so that a pool dropped without ``shutdown`` is
    collected, and its finalizer stops them."""

    __slots__ = ("cond", "reads", "writes", "done", "stop", "region")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.reads: deque[PromotionJob | ProbeJob] = deque()
        self.writes: deque[WriteJob] = deque()
        self.done: deque[Job] = deque()
        self.stop = threading.Event()
        self.region: SlotSource | None = None


class IOPool:
    """Threads running jobs against one slot region.

    Owns two bounded queues (reads: promotions and probes; writes), each at
    most ``max_queue`` jobs, and the ``done`` queue of finished jobs, which the
    owner drains with :meth:`take_done`. Reads run before writes. Bounds: a
    job is refused while its queue holds ``max_queue`` jobs or while
    ``max_done`` (``2 * max_queue + threads``) finished jobs wait to be taken;
    the jobs accepted before (at most ``2 * max_queue`` queued and ``threads``
    running) may still finish, so at most ``2 * max_done`` finished jobs wait,
    however rarely the owner polls.

    A pool garbage collected without :meth:`shutdown` stops its threads as
    :meth:`stop` does (each ends once its running job returns).
    """

    def __init__(self, threads: int, max_queue: int) -> None:
        self.max_queue = max_queue
        self.max_done = 2 * max_queue + threads
        shared = self._shared = _Shared()
        self._cond = shared.cond
        self._reads = shared.reads
        self._writes = shared.writes
        self._done = shared.done
        self._threads = [
            threading.Thread(target=_serve, args=(shared,), name=f"kvtier-io-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _stop, shared)

    @property
    def region(self) -> SlotSource | None:
        """The slot region the jobs read and write (None: not attached yet)."""
        return self._shared.region

    @region.setter
    def region(self, region: SlotSource | None) -> None:
        self._shared.region = region

    @property
    def threads(self) -> int:
        """Number of I/O threads."""
        return len(self._threads)

    def reads_full(self) -> bool:
        with self._cond:
            return len(self._reads) >= self.max_queue

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (nothing queued) when its queue is full, too many
        finished jobs wait to be taken, or the pool is stopping."""
        queue: deque = self._writes if isinstance(job, WriteJob) else self._reads
        with self._cond:
            if (self._shared.stop.is_set() or len(queue) >= self.max_queue
                    or len(self._done) >= self.max_done):
                return False
            queue.append(job)
            self._cond.notify()
        return True

    def take_unstarted_promotions(self, submitted_before: float) -> list[PromotionJob]:
        """Remove and return the queued promotions submitted (``started``)
        before ``submitted_before``: no thread took them in time."""
        with self._cond:
            late = [job for job in self._reads
                    if isinstance(job, PromotionJob) and job.started < submitted_before]
            if late:  # in place: ``submit`` picks the queue before it takes the lock
                gone = set(map(id, late))
                kept = [job for job in self._reads if id(job) not in gone]
                self._reads.clear()
                self._reads.extend(kept)
        return late

    def take_done(self) -> list[Job]:
        done = self._done
        out = []
        while done:
            out.append(done.popleft())
        return out

    def has_done(self) -> bool:
        return bool(self._done)

    def queued(self) -> tuple[int, int]:
        """(queued reads, queued writes)."""
        with self._cond:
            return len(self._reads), len(self._writes)

    def sizes(self) -> dict[str, int]:
        """Jobs queued (reads, writes) and finished but not taken yet."""
        with self._cond:
            return {"queued_reads": len(self._reads), "queued_writes": len(self._writes),
                    "done": len(self._done)}

    def stop(self) -> list[WriteJob]:
        """Stop taking jobs and return the queued writes, which never run.
        Queued reads still pass through the threads, as no-ops (their slots
        are given back when the owner applies them); a running job starts no
        further tier call (see the module docstring)."""
        dropped = _stop(self._shared)
        self._finalizer.detach()
        return dropped

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` in all for the threads to end (after
        :meth:`stop`); whether they all did. Threads stuck in a hung tier
        are left behind: they are daemons."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def shutdown(self, timeout_s: float) -> list[WriteJob]:
        """:meth:`stop`, then :meth:`join` for at most ``timeout_s``; return
        the queued writes that were never run."""
        dropped = self.stop()
        self.join(timeout_s)
        return dropped


def _stop(shared: _Shared) -> list[WriteJob]:
    """Set ``shared``'s stop event, wake its threads; return (and forget) the
    queued writes."""
    with shared.cond:
        shared.stop.set()
        dropped = list(shared.writes)
        shared.writes.clear()
        shared.cond.notify_all()
    return dropped


def _serve(shared: _Shared) -> None:
    """An I/O thread: run jobs, reads first, until the pool stops and no read
    is left."""
    cond = shared.cond
    while True:
        with cond:
            while not shared.reads and not shared.writes and not shared.stop.is_set():
                cond.wait()
            if shared.reads:
                job: Job = shared.reads.popleft()
            elif shared.writes:
                job = shared.writes.popleft()
            else:
                return
        try:
            with quick_handoffs():  # its calls' GIL hand-offs beside a busy scheduler
                job.run(shared.region, shared.stop)
        except Exception as exc:
            _warn.warning("kvtier cascade: I/O job failed: %s", exc)
        shared.done.append(job)
