"""An engine-faithful replay: requests in flight together, late and reordered completions.

``replay_engine`` drives an ``OffloadManager`` the way an engine's scheduler
does, in discrete steps. Per request: ``lookup`` (its prefix hits, leased),
``prepare_load`` of the hits with the load's completion arriving later,
then a store offer of all its blocks (``prepare_store``) with the completions
arriving later, then ``on_request_finished``. Options:

* ``concurrency``: requests in flight; a new one starts when one finishes;
* ``max_delay``: each load or store completes 0..max_delay steps after it was
  issued, in up to two pieces, delivered in random order (so completions of
  different requests, and of one request's pieces, arrive out of order;
  store completions may arrive after the request finished);
* allocation failures: when ``prepare_store`` returns None (every block is
  pinned, leased or being written), the request retries at the next step, up
  to ``max_store_retries`` times, then finishes without storing;
* ``preempt``: the probability that a request is preempted right after its
  store offer; it is resumed ``resume_after`` steps later through the same
  context (lookup, load and store offer again, which the manager neither
  counts again for admission nor as another access), then finishes.

Everything random comes from ``random.Random(seed)``. With ``concurrency=1``,
``max_delay=0`` and no preemption it makes the same manager calls, with the
same results, as the sequential ``replay``.
"""

from __future__ import annotations

import functools
import heapq
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.manager import OffloadManager
from kvtier.replay.driver import PROGRESS_EVERY, ProgressCallback, ReplayResult, replay_manager
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS
from kvtier.request import RequestContext

LOADING, STORING, PREEMPTED, FINISHING, DONE = (
    "loading", "storing", "preempted", "finishing", "done")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine driver schedules requests and completions (see the module doc)."""

    concurrency: int = 4
    max_delay: int = 2
    preempt: float = 0.0
    resume_after: int = 2
    max_store_retries: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("concurrency",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("max_delay", "resume_after", "max_store_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not 0.0 <= self.preempt < 1.0:
            raise ValueError(f"preempt must be in [0, 1), got {self.preempt!r}")


@dataclass(slots=True)
class _Request:
    index: int
    keys: list[bytes]
    ctx: RequestContext
    state: str = LOADING
    pending_loads: int = 0
    retries: int = 0
    preempted: bool = False
    resume_at: int = 0


@dataclass(slots=True)
class EngineStats:
    """What the engine driver counted besides the manager's own counters."""

    hits: int = 0
    manager_seconds: float = 0.0
    preemptions: int = 0
    store_retries: int = 0
    stores_abandoned: int = 0
    late_store_completions: int = 0
    steps: int = 0
    max_in_flight: int = 0
    events: list[tuple[int, str, int]] = field(default_factory=list)


class _Engine:
    def __init__(self, mgr: OffloadManager, requests: Sequence[list[bytes]],
                 config: EngineConfig, record: bool) -> None:
        self.mgr = mgr
        self.requests = requests
        self.config = config
        self.rng = random.Random(config.seed)
        self.stats = EngineStats()
        self.record = record
        self._due: list[tuple[int, int, Callable[[], None]]] = []
        self._serial = 0
        self.step = 0

    # -- helpers ----------------------------------------------------------------

    def _note(self, what: str, index: int) -> None:
        if self.record:
            self.stats.events.append((self.step, what, index))

    def _timed(self, call: Callable[[], _T]) -> _T:
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.stats.manager_seconds += time.perf_counter() - start

    def _later(self, action: Callable[[], None]) -> None:
        """Run ``action`` 0..max_delay steps from now (same-step ones at this step's end)."""
        delay = self.rng.randint(0, self.config.max_delay) if self.config.max_delay else 0
        self._serial += 1
        heapq.heappush(self._due, (self.step + delay, self._serial, action))

    def _split(self, keys: list[bytes]) -> list[list[bytes]]:
        """One or two pieces of a transfer, completed separately."""
        if len(keys) < 2 or not self.config.max_delay or self.rng.random() < 0.5:
            return [keys]
        cut = self.rng.randint(1, len(keys) - 1)
        return [keys[:cut], keys[cut:]]

    def deliver(self) -> None:
        """Run the completions due by now, in random order when several are due."""
        due = []
        while self._due and self._due[0][0] <= self.step:
            due.append(heapq.heappop(self._due)[2])
        if len(due) > 1:
            self.rng.shuffle(due)
        for action in due:
            action()

    # -- request phases -----------------------------------------------------------

    def start(self, req: _Request) -> None:
        """Lookup, then load the hits (completion later)."""
        mgr, ctx, keys = self.mgr, req.ctx, req.keys
        hits = self._timed(lambda: mgr.lookup(keys, ctx))
        if not req.preempted:
            self.stats.hits += hits
        self._note("lookup", req.index)
        req.state = LOADING
        if not hits:
            return
        loaded = keys[:hits]
        self._timed(lambda: mgr.prepare_load(loaded, ctx))
        for piece in self._split(loaded):
            req.pending_loads += 1
            self._later(functools.partial(self._loaded, req, piece))

    def _loaded(self, req: _Request, piece: list[bytes]) -> None:
        self._timed(lambda: self.mgr.complete_load(piece, req.ctx))
        req.pending_loads -= 1

    def offer(self, req: _Request) -> None:
        """Offer every block for storing; retry on an allocation failure."""
        mgr, ctx = self.mgr, req.ctx
        out = self._timed(lambda: mgr.prepare_store(req.keys, ctx))
        if out is None:
            if req.retries < self.config.max_store_retries:
                req.retries += 1
                self.stats.store_retries += 1
                self._note("retry", req.index)
                return  # still STORING: try again next step
            self.stats.stores_abandoned += 1
            self._note("abandon", req.index)
        elif out.keys_to_store:
            for piece in self._split(list(out.keys_to_store)):
                self._later(functools.partial(self._stored, req, piece))
        self._note("offer", req.index)
        req.retries = 0
        cfg = self.config
        if not req.preempted and cfg.preempt and self.rng.random() < cfg.preempt:
            req.preempted = True
            req.state = PREEMPTED
            req.resume_at = self.step + cfg.resume_after
            self.stats.preemptions += 1
            self._note("preempt", req.index)
            return
        req.state = FINISHING

    def _stored(self, req: _Request, piece: list[bytes]) -> None:
        self._timed(lambda: self.mgr.complete_store(piece, req.ctx))
        if req.state == DONE:
            self.stats.late_store_completions += 1

    def finish(self, req: _Request) -> None:
        self._timed(lambda: self.mgr.on_request_finished(req.ctx))
        req.state = DONE
        self._note("finish", req.index)

    # -- the loop -------------------------------------------------------------------

    def _next_busy_step(self, in_flight: list[_Request]) -> int:
        """The first step from now at which a request in flight can act (no new
        one may start): the steps before it would change nothing, and the loop
        skips them, so a large ``max_delay`` costs no idle iterations (with
        ``max_delay`` 10**20 it would never end). ``self.step`` when one can act now."""
        now = self.step
        nexts = [self._due[0][0]] if self._due else []
        for req in in_flight:
            if req.state == PREEMPTED:
                nexts.append(req.resume_at)
            elif req.state != LOADING or not req.pending_loads:
                return now  # it acts at every step (a store retry, a finish)
        return max(now, min(nexts)) if nexts else now

    def run(self, progress: ProgressCallback | None, every: int) -> None:
        queue = deque(range(len(self.requests)))
        in_flight: list[_Request] = []
        finished_since = 0
        cfg = self.config
        while queue or in_flight or self._due:
            while queue and len(in_flight) < cfg.concurrency:
                i = queue.popleft()
                keys = self.requests[i]
                ctx = RequestContext(f"req-{i}")
                ctx.set_positions(keys, MOONCAKE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS)
                req = _Request(i, keys, ctx)
                in_flight.append(req)
                self.start(req)
            self.stats.max_in_flight = max(self.stats.max_in_flight, len(in_flight))
            self.deliver()
            still: list[_Request] = []
            for req in in_flight:
                if req.state == PREEMPTED and self.step >= req.resume_at:
                    self.start(req)  # resumed: lookup and load again
                if req.state == LOADING and not req.pending_loads:
                    req.state = STORING
                if req.state == STORING:
                    self.offer(req)
                    self.deliver()  # completions due at once arrive before the finish
                if req.state == FINISHING:
                    self.finish(req)
                    finished_since += 1
                else:
                    still.append(req)
            in_flight = still
            self.deliver()
            if progress is not None and finished_since >= every:
                progress(finished_since)
                finished_since = 0
            self.step += 1
            if not queue or len(in_flight) >= cfg.concurrency:
                self.step = max(self.step, self._next_busy_step(in_flight))
        self.stats.steps = self.step
        if progress is not None and finished_since:
            progress(finished_since)


def replay_engine(
    requests: Sequence[list[bytes]],
    capacity: int,
    policy: str = "lru",
    config: EngineConfig | None = None,
    *,
    store_threshold: int = 1,
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    block_bytes: int | None = None,
    progress: ProgressCallback | None = None,
    stats: EngineStats | None = None,
    record_events: bool = False,
) -> ReplayResult:
    """Replay ``requests`` (see ``trace_keys``) through a fresh manager, engine style.

    Lease bounds are the whole cache, as in ``replay``. ``hit_blocks`` counts
    each request's first lookup; ``us_per_key`` is manager time per offered
    key. Pass ``stats`` to receive the driver's own counters (and, with
    ``record_events``, the ``(step, what, request)`` log).
    """
    config = config or EngineConfig()
    mgr = replay_manager(capacity, policy, store_threshold, max_tracker_size)
    engine = _Engine(mgr, requests, config, record_events)
    engine.run(progress, PROGRESS_EVERY)
    if stats is not None:
        for name in EngineStats.__slots__:
            setattr(stats, name, getattr(engine.stats, name))
    return ReplayResult.from_manager(
        mgr, requests, engine.stats.hits, engine.stats.manager_seconds, block_bytes,
        policy=policy,
        driver="engine",
        concurrency=config.concurrency,
        preemptions=engine.stats.preemptions,
        stores_abandoned=engine.stats.stores_abandoned,
    )
