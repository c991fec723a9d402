"""Replay a trace through kvtier behind a model of the engine's own prefix cache.

In serving, vLLM's GPU prefix cache (``kvtier.replay.gpu_cache``) answers
first, and vLLM's offloading connector
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``,
``OffloadingConnectorScheduler``) talks to kvtier only about the rest. The
engine runs requests as ``kvtier.replay.engine_schedule`` models it (a fixed
number in flight, or vLLM's scheduler over a saturated queue); this module is
the connector side over an ``OffloadManager``. What the connector does in vLLM
0.32, for a request of ``num_tokens`` tokens, n full blocks (only full blocks
have keys: ``Request.block_hashes``), with e engine-hit blocks:

* lookup (``get_num_new_matched_tokens`` → ``_lookup_complete_chunks`` →
  ``_maximal_prefix_lookup``): kvtier is asked about blocks e, e+1, ... one
  by one until the first miss, up to the last full block (the cap is
  ``num_tokens``, not ``num_tokens - 1``: the last block of an aligned prompt
  can be loaded; the scheduler then recomputes only its last token). It is
  asked at every step the request waits to be admitted; a resumed
  (preempted) request's full blocks include those its output filled, which
  kvtier is asked about as well (never offered, so a miss). A request with a
  hit that another request is loading in this step is answered "not yet"
  (``_chunks_being_loaded``) and asked again next step;
* load (``update_state_after_alloc``): the h hits are loaded into new engine
  blocks (``prepare_load`` at admission, ``complete_load`` after the step);
* store offers (``build_connector_meta`` → ``_build_store_jobs``): at each step
  the request is scheduled in, ``prepare_store`` gets its full prompt blocks
  (``offload_prompt_only``, vLLM's default) up to the tokens computed after the
  step, from ``next_stored_chunk_idx`` on. That index starts at 0 and moves on
  after each granted offer; ``update_state_after_alloc`` sets it to e + h when
  h > 0 (kvtier's adapter keeps vLLM's default ``OffloadPolicy.CHUNK_LEVEL``).
  So a request with kvtier hits offers only the blocks it computes; one without
  any offers every block, its engine hits included. An offer that fails
  (``None``) is retried at the request's next step. Stores complete after the
  step;
* finish: ``on_request_finished`` in the step after the request left the engine
  (``build_connector_meta``, after that step's lookups and offers);
* the metric (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``;
  ``vllm/v1/metrics/stats.py``, ``PrefixCacheStats.record``):
  ``vllm:external_prefix_cache_queries`` adds ``num_tokens - local hit tokens``
  per admitted request, ``vllm:external_prefix_cache_hits`` the tokens loaded;
  resumed (preempted) requests are counted apart, not in these.

The trace is replayed as the serving benchmark serves it (``served_requests``:
``kvtier.replay.serving_trace.scaled``, 32-token engine blocks, outputs capped, and
vLLM's client expanding each hash id into one block of tokens,
``TimedTrace._expand_prompt``): a request has ``input_length // 512`` full
blocks and a partial last block, which is never cached, looked up or offered
but whose tokens are queries.

Ratios, in tokens as vLLM counts them: ``hit_ratio`` = kvtier hit tokens /
tokens kvtier was queried for (the CPU-tier ratio, as
external_prefix_cache_hits / external_prefix_cache_queries); ``gpu_hit_ratio``
= engine hit tokens / prompt tokens (vLLM's prefix cache hit rate);
``combined_hit_ratio`` = (engine + kvtier hit tokens) / prompt tokens. Memory
beyond the manager's: the engine model's (``engine_schedule``) and the
contexts of the requests the engine holds or has asked about.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.manager import OffloadManager
from kvtier.replay.driver import (
    PROGRESS_EVERY,
    ProgressCallback,
    ReplayResult,
    bound_results,
    replay_manager,
    trace_keys,
)
from kvtier.replay.engine_schedule import (
    Connector,
    EngineCounts,
    FixedFront,
    SaturatedScheduler,
    ServedRequest,
    cdiv,
    private_key,
)
from kvtier.replay.gpu_cache import GpuPrefixCache
from kvtier.replay.serving_trace import (
    DEFAULT_OUTPUT_CAP,
    ENGINE_BLOCK_TOKENS,
    NoPromptError,
    scaled,
)
from kvtier.replay.trace import TraceRequest
from kvtier.request import RequestContext


@dataclass(frozen=True, slots=True)
class BehindEngineResult(ReplayResult):
    """A replay's figures behind an engine cache of ``gpu_blocks`` blocks.

    As ``ReplayResult``, except: ``hit_ratio`` is kvtier's CPU-tier ratio in
    tokens, ``hit_tokens`` / ``queried_tokens`` (tokens past each admitted
    request's engine hit); ``hit_blocks`` / ``queried_blocks`` are the same in
    full blocks (those kvtier was asked about); ``offered_blocks`` are the
    requests' full prompt blocks (``us_per_key`` is manager time per such
    block) and ``kvtier_offered_blocks`` the blocks offered to kvtier (an
    offer refused for want of room is retried at the request's next step, as
    vLLM does, and counted again);
    ``gpu_hit_ratio`` = ``gpu_hit_tokens`` / ``prompt_tokens``;
    ``combined_hit_ratio`` = (engine + kvtier hit tokens) / ``prompt_tokens``.
    ``gpu_blocks`` is vLLM's ``num_gpu_blocks`` (one of them its null block).
    ``batch_tokens`` is the scheduler model's token budget per step, 0 for a
    fixed ``concurrency``; then ``concurrency`` is 0 and ``mean_running`` /
    ``max_running`` are the scheduler's requests in flight (per step), to
    compare with the server's ``vllm:num_requests_running``. ``driver`` is
    ``"behind-engine"``, or ``"bound"`` for OPT / infinite rows over the blocks
    kvtier is asked about.
    """

    gpu_blocks: int = 0
    gpu_hit_blocks: int = 0
    gpu_hit_ratio: float = 0.0
    queried_blocks: int = 0
    kvtier_offered_blocks: int = 0
    combined_hit_ratio: float = 0.0
    prompt_tokens: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    gpu_hit_tokens: int = 0
    batch_tokens: int = 0
    mean_running: float = 0.0
    max_running: int = 0


def served_requests(trace: Iterable[TraceRequest], block_tokens: int = ENGINE_BLOCK_TOKENS,
                    output_cap: int = DEFAULT_OUTPUT_CAP) -> list[ServedRequest]:
    """The trace's requests as the serving benchmark sends them to the engine.

    ``kvtier.replay.serving_trace.scaled`` maps one 512-token trace block to one
    engine block of ``block_tokens`` tokens and caps outputs; vLLM's client
    then expands the hash ids into at most ``input_length`` tokens, one block
    each (so no more than ``block_tokens * len(hash_ids)``). Keys are the
    full blocks' (``trace_keys``; equal hash ids share one key object).
    ``serving_trace.NoPromptError`` for a request without hash ids, and
    ``serving_trace.MissingLengthError`` for hash ids without an input length
    (both ``ValueError``).
    """
    requests = list(scaled(trace, block_tokens, output_cap))
    out = []
    for i, (request, keys) in enumerate(zip(requests, trace_keys(requests), strict=True)):
        prompt = min(request.input_length, block_tokens * len(request.hash_ids))
        if prompt < 1:
            raise NoPromptError(i)
        out.append(ServedRequest(keys[: prompt // block_tokens], prompt,
                                 request.output_length))
    return out


def sequence_blocks(request: ServedRequest, block_tokens: int) -> int:
    """Engine blocks a request holds at its end (prompt and output but the last
    output token, whose KV is never computed)."""
    return cdiv(request.prompt_tokens + request.output_tokens - 1, block_tokens)


def check_fits(requests: Sequence[ServedRequest], gpu_blocks: int,
               block_tokens: int = ENGINE_BLOCK_TOKENS) -> None:
    """``ValueError`` when ``gpu_blocks`` (vLLM's ``num_gpu_blocks``, one of them
    its null block) cannot hold the longest request: vLLM could never run it."""
    if isinstance(gpu_blocks, bool) or not isinstance(gpu_blocks, int) or gpu_blocks < 2:
        raise ValueError(f"gpu_blocks must be an int >= 2 (one is vLLM's null block), "
                         f"got {gpu_blocks!r}")
    longest = max((sequence_blocks(r, block_tokens) for r in requests), default=0)
    if longest > gpu_blocks - 1:
        raise ValueError(
            f"gpu_blocks={gpu_blocks} ({gpu_blocks - 1} usable) is smaller than the "
            f"longest request ({longest} blocks): the engine could not run it")


@dataclass(slots=True)
class ConnectorCounts:
    """What the connector counted: vLLM's external-prefix-cache metric (tokens)
    and the blocks kvtier was asked about, hit and offered."""

    query_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    offered_blocks: int = 0
    seconds: float = 0.0


class KvtierConnector:
    """vLLM's offloading connector (scheduler side) over an ``OffloadManager``
    (the ``Connector`` calls; see the module doc for what each does).

    Owns each request's context while the engine holds it or has asked about
    it, the next block each will offer, the loads and stores issued in the
    current step (and the set of keys those loads carry, cleared at each step's
    end), and the counts. Only manager calls are timed.
    """

    def __init__(self, mgr: OffloadManager, requests: Sequence[ServedRequest],
                 block_tokens: int, progress: ProgressCallback | None = None) -> None:
        self.mgr = mgr
        self.requests = requests
        self.block_tokens = block_tokens
        self.counts = ConnectorCounts()
        self._progress = progress
        self._pending_progress = 0
        self._ctx: dict[int, RequestContext] = {}
        self._next_store: dict[int, int] = {}
        self._loads: list[tuple[list[bytes], RequestContext]] = []
        self._loading_keys: set[bytes] = set()
        self._stores: list[tuple[list[bytes], RequestContext]] = []

    def _context(self, index: int) -> RequestContext:
        ctx = self._ctx.get(index)
        if ctx is None:
            ctx = self._ctx[index] = RequestContext(f"req-{index}")
            bt = self.block_tokens
            ctx.set_positions(self.requests[index].keys, bt, bt)
        return ctx

    def get_num_new_matched(self, index: int, engine_hits: int,
                            num_tokens: int) -> int | None:
        """kvtier's leading hits among the request's full blocks past the engine
        hit: its prompt blocks, and for a resumed request also the blocks its
        output filled (vLLM asks about every full block of ``num_tokens``;
        kvtier never holds an output block, so the run ends at the first).
        None when a hit is being loaded for another request in this step
        (vLLM's ``_chunks_being_loaded``: the request is asked again next step)."""
        request, bt = self.requests[index], self.block_tokens
        queried = request.keys[engine_hits:]
        full = num_tokens // bt
        if full > len(request.keys):
            queried = [*queried, *(private_key(index, b)
                                   for b in range(max(engine_hits, len(request.keys)), full))]
        if not queried:
            return 0
        ctx = self._context(index)
        start = time.perf_counter()
        hits = self.mgr.lookup(queried, ctx)
        self.counts.seconds += time.perf_counter() - start
        loading = self._loading_keys
        if loading and any(key in loading for key in queried[:hits]):
            return None
        return hits

    def update_state_after_alloc(self, index: int, engine_hits: int, hits: int,
                                 num_tokens: int, preempted: bool) -> None:
        """Count the admission (unless resumed) and load the hits."""
        counts, bt = self.counts, self.block_tokens
        if not preempted:
            counts.query_tokens += num_tokens - engine_hits * bt
            counts.hit_tokens += hits * bt
            counts.queried_blocks += max(0, len(self.requests[index].keys) - engine_hits)
            counts.hit_blocks += hits
        if not hits:
            return
        loaded = self.requests[index].keys[engine_hits:engine_hits + hits]
        ctx = self._context(index)
        start = time.perf_counter()
        self.mgr.prepare_load(loaded, ctx)
        counts.seconds += time.perf_counter() - start
        self._loads.append((loaded, ctx))
        self._loading_keys.update(loaded)
        self._next_store[index] = engine_hits + hits

    def build_meta(self, scheduled: Sequence[tuple[int, int]],
                   finished: Sequence[int]) -> None:
        """Offer each request's newly computed prompt blocks (finished ones: what
        is left of their prompt), then finish the ``finished`` requests."""
        requests = self.requests
        for index, end in [*scheduled, *((i, requests[i].prompt_tokens) for i in finished)]:
            self._offer(index, end)
        start = time.perf_counter()
        for index in finished:
            self._next_store.pop(index, None)
            self.mgr.on_request_finished(self._context(index))
            del self._ctx[index]
        self.counts.seconds += time.perf_counter() - start
        self._report(len(finished))

    def _offer(self, index: int, end: int) -> None:
        request = self.requests[index]
        n = min(end, request.prompt_tokens) // self.block_tokens
        first = self._next_store.get(index, 0)
        if n <= first:
            return
        offer = request.keys[first:n]
        ctx = self._context(index)
        start = time.perf_counter()
        out = self.mgr.prepare_store(offer, ctx)
        self.counts.seconds += time.perf_counter() - start
        self.counts.offered_blocks += len(offer)
        if out is None:
            return  # retried at the request's next step
        self._next_store[index] = n
        if out.keys_to_store:
            self._stores.append((list(out.keys_to_store), ctx))

    def step_end(self) -> None:
        """Complete the loads and stores issued in this step."""
        mgr = self.mgr
        start = time.perf_counter()
        for keys, ctx in self._loads:
            mgr.complete_load(keys, ctx)
        for keys, ctx in self._stores:
            mgr.complete_store(keys, ctx)
        self.counts.seconds += time.perf_counter() - start
        self._loads.clear()
        self._loading_keys.clear()
        self._stores.clear()

    def _report(self, finished: int) -> None:
        if self._progress is None or not finished:
            return
        self._pending_progress += finished
        if self._pending_progress >= PROGRESS_EVERY:
            self._progress(self._pending_progress)
            self._pending_progress = 0

    def flush_progress(self) -> None:
        """Report the finished requests not reported yet."""
        if self._progress is not None and self._pending_progress:
            self._progress(self._pending_progress)
            self._pending_progress = 0


class QueryRecorder:
    """A ``Connector`` with nothing behind the engine: records, per admitted
    request (resumed ones aside), the full blocks kvtier would be asked about.
    Memory: those blocks' keys (the bound rows need them all)."""

    def __init__(self, requests: Sequence[ServedRequest], block_tokens: int) -> None:
        self.requests = requests
        self.block_tokens = block_tokens
        self.streams: list[list[bytes]] = []
        self.query_tokens = 0

    def get_num_new_matched(self, index: int, engine_hits: int, num_tokens: int) -> int:
        """Nothing to load."""
        return 0

    def update_state_after_alloc(self, index: int, engine_hits: int, hits: int,
                                 num_tokens: int, preempted: bool) -> None:
        """Record the admitted request's query."""
        if not preempted:
            self.streams.append(self.requests[index].keys[engine_hits:])
            self.query_tokens += num_tokens - engine_hits * self.block_tokens

    def build_meta(self, scheduled: Sequence[tuple[int, int]],
                   finished: Sequence[int]) -> None:
        """No stores."""

    def step_end(self) -> None:
        """No transfers."""


def run_engine(requests: Sequence[ServedRequest], connector: Connector, *, gpu_blocks: int,
               concurrency: int = 1, batch_tokens: int | None = None,
               block_tokens: int = ENGINE_BLOCK_TOKENS) -> EngineCounts:
    """Serve ``requests`` through an engine of ``gpu_blocks`` blocks (vLLM's
    ``num_gpu_blocks``) driving ``connector``: ``concurrency`` in flight, or,
    with ``batch_tokens``, vLLM's scheduler with that budget per step over a
    queue that never runs dry. ``ValueError`` for a request that cannot fit."""
    check_fits(requests, gpu_blocks, block_tokens)
    cache = GpuPrefixCache(gpu_blocks - 1)
    if batch_tokens is None:
        return FixedFront(cache, block_tokens, connector, concurrency).run(requests)
    return SaturatedScheduler(cache, block_tokens, connector, batch_tokens).run(requests)


def replay_behind_engine(
    requests: Sequence[ServedRequest],
    capacity: int,
    policy: str = "lru",
    *,
    gpu_blocks: int,
    concurrency: int = 1,
    batch_tokens: int | None = None,
    block_tokens: int = ENGINE_BLOCK_TOKENS,
    store_threshold: int = 1,
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    block_bytes: int | None = None,
    progress: ProgressCallback | None = None,
) -> BehindEngineResult:
    """Replay ``requests`` (``served_requests``) through a fresh manager of
    ``capacity`` blocks behind an engine of ``gpu_blocks`` blocks (``run_engine``).

    Lease bounds as in ``replay``; only manager calls are timed. Raises
    ``ValueError`` for a request the engine cannot hold, an unknown policy or
    bad parameters.
    """
    check_fits(requests, gpu_blocks, block_tokens)
    mgr = replay_manager(capacity, policy, store_threshold, max_tracker_size)
    connector = KvtierConnector(mgr, requests, block_tokens, progress)
    engine = run_engine(requests, connector, gpu_blocks=gpu_blocks, concurrency=concurrency,
                        batch_tokens=batch_tokens, block_tokens=block_tokens)
    connector.flush_progress()
    c = connector.counts
    keys = [r.keys for r in requests]
    base = ReplayResult.from_manager(
        mgr, keys, c.hit_blocks, c.seconds, block_bytes, policy=policy,
        driver="behind-engine", concurrency=concurrency if batch_tokens is None else 0,
        preemptions=engine.preemptions)
    return BehindEngineResult(
        **{**base.to_dict(), "hit_ratio": _ratio(c.hit_tokens, c.query_tokens)},
        **_engine_fields(gpu_blocks, engine, c.hit_tokens, batch_tokens),
        queried_blocks=c.queried_blocks, kvtier_offered_blocks=c.offered_blocks,
        queried_tokens=c.query_tokens, hit_tokens=c.hit_tokens,
    )


def engine_miss_streams(
    requests: Sequence[ServedRequest], gpu_blocks: int, concurrency: int = 1,
    batch_tokens: int | None = None, block_tokens: int = ENGINE_BLOCK_TOKENS,
) -> tuple[list[list[bytes]], EngineCounts, int]:
    """Each admitted request's full blocks past its engine hit (what kvtier is
    asked about), the engine's counts and the tokens kvtier is queried for,
    with nothing behind the engine."""
    recorder = QueryRecorder(requests, block_tokens)
    counts = run_engine(requests, recorder, gpu_blocks=gpu_blocks, concurrency=concurrency,
                        batch_tokens=batch_tokens, block_tokens=block_tokens)
    return recorder.streams, counts, recorder.query_tokens


def behind_engine_bounds(
    requests: Sequence[ServedRequest],
    capacities: Iterable[int],
    *,
    gpu_blocks: int,
    concurrency: int = 1,
    batch_tokens: int | None = None,
    block_tokens: int = ENGINE_BLOCK_TOKENS,
    opt: bool = True,
    infinite: bool = True,
    block_bytes: int | None = None,
) -> list[BehindEngineResult]:
    """OPT per capacity and the infinite cache over the blocks kvtier is asked
    about behind the engine cache (``bound_results`` on ``engine_miss_streams``).

    Block hits over those queries only: a cache behind the engine also sees
    offers of engine hits (requests without kvtier hits offer every block), which
    it could use to keep a block again, so these rows are the optimum of a
    cache that sees only the queries, not a strict bound on kvtier. With the
    scheduler model the engine's timing depends a little on kvtier's hits
    (loads take a step); these rows take the engine with nothing behind it.
    """
    streams, engine, query_tokens = engine_miss_streams(
        requests, gpu_blocks, concurrency, batch_tokens, block_tokens)
    rows = bound_results(streams, capacities, opt=opt, infinite=infinite,
                         block_bytes=block_bytes)
    out = []
    for row in rows:
        hit_tokens = row.hit_blocks * block_tokens
        fields = {**row.to_dict(), "offered_blocks": sum(len(r.keys) for r in requests),
                  "concurrency": concurrency if batch_tokens is None else 0,
                  "hit_ratio": _ratio(hit_tokens, query_tokens)}
        fields.update(_engine_fields(gpu_blocks, engine, hit_tokens, batch_tokens))
        out.append(BehindEngineResult(
            **fields, queried_blocks=row.offered_blocks, queried_tokens=query_tokens,
            hit_tokens=hit_tokens))
    return out


def _engine_fields(gpu_blocks: int, engine: EngineCounts, kv_hit_tokens: int,
                   batch_tokens: int | None) -> dict[str, Any]:
    """The engine's ``BehindEngineResult`` fields."""
    return {
        "gpu_blocks": gpu_blocks,
        "gpu_hit_blocks": engine.hit_blocks,
        "gpu_hit_ratio": _ratio(engine.hit_tokens, engine.query_tokens),
        "combined_hit_ratio": _ratio(engine.hit_tokens + kv_hit_tokens, engine.query_tokens),
        "prompt_tokens": engine.query_tokens,
        "gpu_hit_tokens": engine.hit_tokens,
        "batch_tokens": batch_tokens or 0,
        "mean_running": engine.mean_running,
        "max_running": engine.max_running,
    }


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
