"""How vLLM's engine runs requests over its block pool, for the replay lab.

Two models of the engine in front of kvtier, both over a ``GpuPrefixCache``
and both driving a ``Connector`` (the offloading connector's scheduler side)
with the calls vLLM makes, in vLLM's order:

* ``FixedFront``: a fixed number of requests in flight. A request takes all its
  blocks when it starts (the decode ones too), and the oldest running requests
  finish when a new one needs the room or a slot. For a server that is not
  saturated, with the number in flight taken from the server's own
  ``vllm:num_requests_running`` (``kvtier replay --driver engine --concurrency N``).
* ``SaturatedScheduler``: vLLM's scheduler step by step with a queue that never
  runs dry (every request waits from the start, in trace order): for a server
  whose ``vllm:num_requests_waiting`` stays above 0. The number in flight is
  then the scheduler's, set by the token budget and the blocks; nothing is
  fitted.

Which one, from a measurement of the real server (never from its hit ratio):
scrape its ``/metrics`` during the run (or read its periodic log line
``Running: N reqs, Waiting: M reqs``). When ``vllm:num_requests_waiting``
stays above 0 for most of the run (a saturated server: TTFT grows, throughput
stays below the arrival rate), use ``SaturatedScheduler`` with the server's
``max_num_batched_tokens`` (``kvtier replay --gpu-batch-tokens N``), and check
its ``mean_running`` against the measured mean of ``vllm:num_requests_running``
(both count ``Scheduler.running``, which leaves out requests waiting for a
load; the model's mean is per step, the gauge's per second). Otherwise use
``FixedFront`` with ``concurrency`` = the time average of
``vllm:num_requests_running`` over the run, rounded, at least 1.

What ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` does in vLLM
0.32, and ``SaturatedScheduler`` mirrors (no speculative decoding, one KV-cache
group, chunked prefill on, FCFS):

* a step has a budget of ``max_num_batched_tokens`` tokens (2048 for the CPU
  platform's API server: ``EngineArgs.get_batch_defaults``). Running requests
  are scheduled first, in admission order: the rest of their prefill, cut to
  the budget (chunked prefill), or one decode token. A request that cannot get
  the blocks its step needs preempts the last running request (freeing its
  blocks; it goes back to the front of the queue with its output kept and is
  counted apart by the metrics), or stops the pass when it is the last one;
* then, only in a step without preemption, waiting requests are admitted in
  order while budget is left and fewer than ``max_num_seqs`` run (128 on the
  CPU platform's server). Requests whose connector load finished come first
  (``kv_holding_waiting``). A new request's engine hit (capped at
  ``num_tokens - 1`` tokens) is taken, then the connector is asked for more
  (``get_num_new_matched_tokens``; asked again at every step the request waits;
  a resumed request is asked about the blocks its output filled too). A
  request the connector cannot answer for yet (one of its hits is being
  loaded for another request) is passed over for this step and keeps its
  place (``skip_request``); the pass goes on with the next. A request is
  admitted when the free blocks cover its whole sequence
  (``scheduler_reserve_full_isl``, default True: ``allocate_slots(...,
  full_sequence_must_fit=True)``), else the pass ends (FCFS). With connector
  hits it only takes its hit and loaded blocks and waits for the load (an
  asynchronous load: those blocks must also fit in the free blocks less what
  other in-flight prefills still need, ``_inflight_prefill_reserved_blocks``);
  the loaded blocks are cached when the load is done
  (``_update_waiting_for_remote_kv``), and a fully loaded prompt recomputes
  its last token;
* ``allocate_slots`` allocates the blocks of the tokens scheduled and caches
  the blocks they fill, so a block is hashed (and can be hit) from the step
  that computes it;
* after the step the requests sample a token; one that has all its output
  tokens finishes and its blocks are freed then
  (``update_from_output`` → ``_free_request``); the connector hears of it
  (``request_finished`` → the manager's ``on_request_finished``) in the next
  step's ``build_connector_meta``, after that step's lookups and stores.

Not modelled: arrival times (the queue is never empty), sliding windows,
speculative decoding, loads and stores that outlast their step. Memory: the block pool's
O(``gpu_blocks``) and O(1) per request of the trace besides its keys (its
state, and the private keys of its decode blocks once it has some).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvtier.replay.gpu_cache import GpuPrefixCache

CPU_MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's default ``max_num_batched_tokens`` for the CPU platform's API server."""

CPU_MAX_NUM_SEQS = 128
"""vLLM's default ``max_num_seqs`` for the CPU platform's API server."""


@dataclass(frozen=True, slots=True)
class ServedRequest:
    """A request as the engine gets it: the keys of its full prompt blocks
    (what kvtier can see), its prompt length and the tokens it generates."""

    keys: list[bytes]
    prompt_tokens: int
    output_tokens: int


class Connector(Protocol):
    """The connector calls the engine models make (vLLM's ``KVConnectorBase_V1``
    scheduler side, reduced to what the offloading connector does here)."""

    def get_num_new_matched(self, index: int, engine_hits: int, num_tokens: int) -> int | None:
        """Blocks past the engine hit the connector can load for request
        ``index``, now ``num_tokens`` long (a resumed request's output too);
        None when it cannot tell yet (the request waits a step)."""

    def update_state_after_alloc(self, index: int, engine_hits: int, hits: int,
                                 num_tokens: int, preempted: bool) -> None:
        """Request ``index`` was admitted with these hits (load and count them)."""

    def build_meta(self, scheduled: Sequence[tuple[int, int]],
                   finished: Sequence[int]) -> None:
        """Store offers for ``(request, tokens computed after the step)``, then
        the finishes of the requests that left the engine since the last call."""

    def step_end(self) -> None:
        """The step ran: loads and stores issued in it are complete."""


class EngineStalledError(RuntimeError):
    """The engine model can neither run nor admit anything (a bug, or a trace
    whose requests hold the whole pool while waiting for each other)."""


@dataclass(slots=True)
class EngineCounts:
    """What the engine model counted: vLLM's ``prefix_cache_queries`` /
    ``_hits`` in tokens (new requests only, as the metric), the hit blocks."""

    query_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    preemptions: int = 0
    steps: int = 0
    running_sum: int = 0
    max_running: int = 0

    @property
    def mean_running(self) -> float:
        """Mean number of running requests over the steps (after each step, as
        vLLM's ``vllm:num_requests_running``; ``FixedFront``: after each start)."""
        return self.running_sum / self.steps if self.steps else 0.0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``."""
    return -(-a // b)


def private_key(index: int, block: int) -> bytes:
    """The key of block ``block`` of request ``index`` when only that request can
    fill it (blocks that decoding completes: their tokens are its output).

    19 bytes, so it never equals a trace key (``kvtier.keys.block_key``: 12).
    """
    return b"\x00dec" + index.to_bytes(8, "big") + block.to_bytes(7, "big")


@dataclass(slots=True)
class _Req:
    """One request's engine state."""

    index: int
    req: ServedRequest
    keys: list[bytes] = field(default_factory=list)
    generated: int = 0
    computed: int = 0
    preempted: bool = False
    loaded: int = 0

    @property
    def name(self) -> str:
        return f"req-{self.index}"

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.generated

    def full_keys(self, blocks: int) -> list[bytes]:
        """Keys of the first ``blocks`` full blocks (prompt keys, then private ones)."""
        keys = self.keys
        if len(keys) < blocks:
            if keys is self.req.keys:
                keys = self.keys = list(keys)  # the prompt's list stays the caller's
            keys.extend(private_key(self.index, b) for b in range(len(keys), blocks))
        return keys[:blocks]

    def count(self, counts: EngineCounts, hits: int, block_tokens: int) -> None:
        """Count this admission in vLLM's prefix-cache metric (not a resumed one)."""
        if not self.preempted:
            counts.query_tokens += self.num_tokens
            counts.hit_tokens += hits * block_tokens
            counts.hit_blocks += hits


def _new_reqs(requests: Sequence[ServedRequest]) -> list[_Req]:
    return [_Req(i, r, r.keys) for i, r in enumerate(requests)]


class FixedFront:
    """The engine with ``concurrency`` requests in flight (see the module doc).

    A request starts on its engine hit, takes the blocks of its whole sequence
    (prompt and decode) and asks the connector; then its prefill runs in steps
    of at most ``batch_tokens`` tokens (chunked prefill), each step offering
    the prompt blocks it completed, then it decodes (one step per output token
    but the last, each retrying an offer kvtier refused, as vLLM does at every
    step a request is scheduled in). With kvtier hits the load takes a step of
    its own first (vLLM's loads are asynchronous: the request computes nothing
    until its load is done), so its offers come after the load completed.

    The oldest running requests finish first when the new request needs their
    slot or their blocks. A request that gave up its slot finished before the
    new one arrived: vLLM steps again right after a request finishes
    (``Scheduler.has_requests`` counts finished requests) and that step's
    ``build_connector_meta`` tells the connector, so kvtier hears of it before
    the new request's lookup. One that gave up its blocks finished while the
    new request waited for them: the connector hears of it in the step that
    admits the new request, after its lookup, load and first offer. Memory:
    the pool's and ``concurrency`` request ids.
    """

    def __init__(self, cache: GpuPrefixCache, block_tokens: int, connector: Connector,
                 concurrency: int = 1,
                 batch_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS) -> None:
        for name, value in (("concurrency", concurrency), ("batch_tokens", batch_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.cache = cache
        self.block_tokens = block_tokens
        self.connector = connector
        self.concurrency = concurrency
        self.batch_tokens = batch_tokens
        self.counts = EngineCounts()
        self._running: deque[_Req] = deque()

    def run(self, requests: Sequence[ServedRequest]) -> EngineCounts:
        """Serve ``requests`` in order; return the counts."""
        for r in _new_reqs(requests):
            self.admit(r)
        self._step([], [r.index for r in self._drain()])
        return self.counts

    def admit(self, r: _Req) -> None:
        """Start ``r``, finishing the oldest running requests first as needed."""
        cache, bt, running, counts = self.cache, self.block_tokens, self._running, self.counts
        if len(running) >= self.concurrency:
            self._step([], [self._finish_oldest().index])  # heard of before r arrives
        prompt = r.req.prompt_tokens
        hits = cache.match(r.keys, (prompt - 1) // bt)  # finishing frees, uncaches nothing
        total = cdiv(prompt + r.req.output_tokens - 1, bt)
        finished = []  # r waited for their blocks: heard of in the step admitting r
        while running and cache.admission_cost(r.keys, hits, total) > cache.free_blocks:
            finished.append(self._finish_oldest().index)
        cache.start(r.name, r.keys, hits)
        cache.grow(r.name, total)
        cache.commit(r.name, r.keys[: prompt // bt])
        running.append(r)
        r.count(counts, hits, bt)
        counts.steps += 1
        counts.running_sum += len(running)
        counts.max_running = max(counts.max_running, len(running))
        # nothing loads in a step a request arrives in, so no lookup is deferred
        kv_hits = self.connector.get_num_new_matched(r.index, hits, prompt) or 0
        self.connector.update_state_after_alloc(r.index, hits, kv_hits, prompt, False)
        computed = hits * bt
        if kv_hits:  # the load's step: r is not scheduled in it, so offers nothing
            self._step([], finished)
            finished = []
            computed = min((hits + kv_hits) * bt, prompt - 1)  # a full hit recomputes one token
        while computed < prompt:
            computed = min(prompt, computed + self.batch_tokens)
            self._step([(r.index, computed)], finished)
            finished = []
        for _ in range(r.req.output_tokens - 1):  # decode steps retry a refused offer
            self._step([(r.index, prompt)], [])

    def _step(self, scheduled: Sequence[tuple[int, int]], finished: Sequence[int]) -> None:
        """One engine step as the connector sees it: offers, finishes, completions."""
        self.connector.build_meta(scheduled, finished)
        self.connector.step_end()

    def _drain(self) -> list[_Req]:
        return [self._finish_oldest() for _ in range(len(self._running))]

    def _finish_oldest(self) -> _Req:
        r = self._running.popleft()
        full = (r.req.prompt_tokens + r.req.output_tokens - 1) // self.block_tokens
        self.cache.commit(r.name, r.full_keys(full))  # blocks decoding filled
        self.cache.free(r.name)
        return r


class SaturatedScheduler:
    """vLLM's scheduler over a queue that never runs dry (see the module doc).

    Checked against vLLM 0.32's own ``Scheduler`` with requests arriving
    together (``tests/test_lab_fidelity_saturated.py``): kvtier gets the same
    calls in the same order. What still differs: vLLM tells the connector of
    the requests that finished in one step in no set order (a set), this model
    in admission order; its ``_inflight_prefills`` holds a resumed request
    until it has recomputed its output too, where ``_reserved`` counts a
    running request only while it is short of its prompt (not seen to change
    the calls); and every load or store here completes in the step it was
    issued in.

    Owns the waiting queue (requests not admitted, trace order; preempted ones
    back at its front), the requests holding loaded blocks, the running list
    (admission order) and the counts. Memory: the pool's and O(1) per request.
    """

    def __init__(self, cache: GpuPrefixCache, block_tokens: int, connector: Connector,
                 batch_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS,
                 max_seqs: int = CPU_MAX_NUM_SEQS) -> None:
        for name, value in (("batch_tokens", batch_tokens), ("max_seqs", max_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.cache = cache
        self.block_tokens = block_tokens
        self.connector = connector
        self.batch_tokens = batch_tokens
        self.max_seqs = max_seqs
        self.counts = EngineCounts()
        self._waiting: deque[_Req] = deque()
        self._holding: deque[_Req] = deque()
        self._loading: list[_Req] = []
        self._running: list[_Req] = []

    def run(self, requests: Sequence[ServedRequest]) -> EngineCounts:
        """Serve ``requests``, all waiting from the start; return the counts."""
        self._waiting.extend(_new_reqs(requests))
        finished: list[int] = []
        while self._waiting or self._holding or self._loading or self._running:
            finished = self.step(finished)
        self.connector.build_meta([], finished)
        self.connector.step_end()
        return self.counts

    def step(self, finished_before: Sequence[int]) -> list[int]:
        """One engine step; return the requests that finished in it."""
        budget = self.batch_tokens
        scheduled: list[tuple[_Req, int]] = []
        budget, preempted = self._schedule_running(budget, scheduled)
        if not preempted:
            self._admit_waiting(budget, scheduled)
        if not (scheduled or self._loading or preempted):
            raise EngineStalledError(
                f"the engine model is stalled at step {self.counts.steps}: "
                f"{len(self._holding)} requests hold loaded blocks, "
                f"{self.cache.free_blocks} blocks are free")
        self.connector.build_meta([(r.index, r.computed + n) for r, n in scheduled],
                                  finished_before)
        self.connector.step_end()
        done = self._execute(scheduled)
        counts = self.counts  # as vLLM's gauge: len(Scheduler.running) after the step
        counts.steps += 1
        counts.running_sum += len(self._running)
        counts.max_running = max(counts.max_running, len(self._running))
        return done

    # -- scheduling ----------------------------------------------------------------

    def _schedule_running(self, budget: int,
                          scheduled: list[tuple[_Req, int]]) -> tuple[int, bool]:
        """Schedule running requests in order; return the budget left and
        whether some request was preempted."""
        running, preempted = self._running, False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.computed, budget)
            blocks = cdiv(r.computed + n, self.block_tokens)
            while blocks - self.cache.held(r.name) > self.cache.free_blocks:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is r:
                    return budget, preempted
            self._allocate(r, n)
            scheduled.append((r, n))
            budget -= n
            i += 1
        return budget, preempted

    def _admit_waiting(self, budget: int, scheduled: list[tuple[_Req, int]]) -> None:
        """Admit waiting requests while budget, slots and blocks allow (FCFS);
        a request whose lookup the connector deferred is passed over for this
        step and keeps its place at the queue's front (vLLM's ``skip_request``)."""
        skipped: list[_Req] = []
        self._admit_in_order(budget, scheduled, skipped)
        self._waiting.extendleft(reversed(skipped))

    def _admit_in_order(self, budget: int, scheduled: list[tuple[_Req, int]],
                        skipped: list[_Req]) -> None:
        cache, bt = self.cache, self.block_tokens
        while budget > 0 and len(self._running) < self.max_seqs:
            queue = self._holding or self._waiting
            if not queue:
                return
            r = queue[0]
            if r.computed:  # its load is done: continue it
                if cdiv(r.num_tokens, bt) - cache.held(r.name) > cache.free_blocks:
                    return
            else:
                admitted = self._admit_new(r)
                if admitted == "full":
                    return
                if admitted != "run":  # loading (holds its blocks) or deferred
                    queue.popleft()
                    if admitted == "deferred":
                        skipped.append(r)
                    continue
            queue.popleft()
            n = min(r.num_tokens - r.computed, budget)
            self._allocate(r, n)
            self._running.append(r)
            scheduled.append((r, n))
            budget -= n

    def _admit_new(self, r: _Req) -> Literal["full", "deferred", "load", "run"]:
        """Look ``r`` up and admit it: "full" when it does not fit (the pass
        ends), "deferred" when the connector cannot answer yet (its hits are
        being loaded for another request), "load" when it waits for a load,
        "run" when it is ready to compute."""
        cache, bt = self.cache, self.block_tokens
        tokens = r.num_tokens
        keys = r.full_keys(tokens // bt)
        hits = cache.match(keys, (tokens - 1) // bt)
        kv_hits = self.connector.get_num_new_matched(r.index, hits, tokens)
        if kv_hits is None:
            return "deferred"
        if cache.admission_cost(keys, hits, cdiv(tokens, bt)) > cache.free_blocks:
            return "full"  # its whole sequence must fit (scheduler_reserve_full_isl)
        if kv_hits and (cache.admission_cost(keys, hits, hits + kv_hits)
                        > cache.free_blocks - self._reserved()):
            return "full"  # an asynchronous load takes only its blocks, within
            # what the prefills in flight leave (allocate_slots' reserved_blocks)
        cache.start(r.name, keys, hits)
        r.count(self.counts, hits, bt)
        self.connector.update_state_after_alloc(r.index, hits, kv_hits, tokens, r.preempted)
        r.computed = hits * bt
        if not kv_hits:
            return "run"
        cache.grow(r.name, hits + kv_hits)
        r.loaded = hits + kv_hits
        self._loading.append(r)
        return "load"

    def _reserved(self) -> int:
        """Blocks the prefills in flight still need (``_inflight_prefill_reserved_blocks``)."""
        bt, cache = self.block_tokens, self.cache
        flight = [r for r in self._running if r.computed < r.req.prompt_tokens]
        flight += self._loading + list(self._holding)
        return sum(max(0, cdiv(r.num_tokens, bt) - cache.held(r.name)) for r in flight)

    def _allocate(self, r: _Req, n: int) -> None:
        """Give ``r`` the blocks of its next ``n`` tokens and cache those they fill."""
        bt, end = self.block_tokens, r.computed + n
        self.cache.grow(r.name, cdiv(end, bt))
        self.cache.commit(r.name, r.full_keys(min(end, r.num_tokens) // bt))

    def _preempt(self, r: _Req) -> None:
        """Free ``r``'s blocks and put it back at the queue's front (output kept)."""
        self.cache.free(r.name)
        r.computed = 0
        r.preempted = True
        self._waiting.appendleft(r)
        self.counts.preemptions += 1

    # -- the step ran ----------------------------------------------------------------

    def _execute(self, scheduled: list[tuple[_Req, int]]) -> list[int]:
        """Advance the scheduled requests; finish those with all their output;
        loads issued in this step are done (their blocks cached)."""
        done = []
        for r, n in scheduled:
            r.computed += n
            if r.computed >= r.num_tokens:
                r.generated += 1
                if r.generated >= r.req.output_tokens:
                    done.append(r)
        if done:
            gone = {id(r) for r in done}
            self._running = [r for r in self._running if id(r) not in gone]
        for r in done:
            self.cache.free(r.name)
        bt = self.block_tokens
        for r in self._loading:
            self.cache.commit(r.name, r.full_keys(r.loaded))
            r.computed = min(r.loaded * bt, r.num_tokens - 1)
            self._holding.append(r)
        self._loading = []
        return [r.index for r in done]
