"""Replay a trace through kvtier behind a model of the engine's own prefix cache.

In serving, vLLM's GPU prefix cache (``kvtier.replay.gpu_cache``) answers
first, and vLLM's offloading connector
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``,
``OffloadingConnectorScheduler``) talks to kvtier only about the rest. What
the connector does in vLLM 0.32, for a prompt of n blocks with e engine hits:

* lookup (``get_num_new_matched_tokens`` → ``_lookup_complete_chunks`` →
  ``_maximal_prefix_lookup``): kvtier is asked about blocks e, e+1, ... one
  by one until the first miss, up to the prompt's last full block (the
  connector's cap is ``num_tokens``, not ``num_tokens - 1``: the last block of
  an aligned prompt can be loaded; the scheduler then recomputes only its last
  token, ``Scheduler._update_waiting_for_remote_kv``);
* load (``update_state_after_alloc``): the h hits are loaded into new engine
  blocks, which the engine caches like computed ones;
* store offer (``_build_store_jobs``): ``prepare_store`` gets the request's
  full blocks from ``next_stored_chunk_idx`` on. That index starts at 0 and
  only ``update_state_after_alloc`` moves it, to e + h, and only when h > 0
  (kvtier's adapter keeps vLLM's default ``OffloadPolicy.CHUNK_LEVEL``). So a
  request with kvtier hits offers only the blocks it computed; a request
  without any offers every block, its engine-cache hits included. With
  ``offload_prompt_only`` (vLLM's default, True) only prompt blocks are offered;
* the metric (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``;
  ``vllm/v1/metrics/loggers.py``): ``vllm:external_prefix_cache_queries`` adds
  ``num_tokens - local hit tokens`` per new request (preempted ones are counted
  apart), ``vllm:external_prefix_cache_hits`` the tokens loaded;
  ``vllm:prefix_cache_queries`` / ``_hits`` are the prompt's tokens and the
  local hit tokens.

Per request, in trace order, this driver: takes the engine hit e (``match``)
and allocates the request's blocks in the engine cache; looks up ``keys[e:]``
in kvtier, loads the h hits; offers ``keys[e + h:]`` when h > 0, else all
``keys``, and completes the stores granted; finishes the request in both when
it leaves the engine. With ``concurrency`` C, up to C requests hold engine
blocks at once: the oldest finishes when a C+1-th starts, or earlier when the
new one needs its blocks. Loads and stores complete at once. Memory beyond
the manager's: the engine cache's O(gpu_blocks) and the contexts of at most C
running requests.

Ratios, in blocks (requests are block-aligned, as in the sequential lab):
``hit_ratio`` = kvtier hits / blocks kvtier was asked about (the CPU-tier
ratio, as external_prefix_cache_hits / external_prefix_cache_queries);
``gpu_hit_ratio`` = engine hits / prompt blocks; ``combined_hit_ratio`` =
(engine + kvtier hits) / prompt blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.manager import OffloadManager
from kvtier.replay.driver import (
    ProgressCallback,
    ReplayResult,
    bound_results,
    replay_manager,
    request_contexts,
)
from kvtier.replay.gpu_cache import GpuPrefixCache
from kvtier.request import RequestContext


@dataclass(frozen=True, slots=True)
class BehindEngineResult(ReplayResult):
    """A replay's figures behind an engine cache of ``gpu_blocks`` blocks.

    As ``ReplayResult``, except: ``hit_blocks`` / ``hit_ratio`` are kvtier's
    hits and its CPU-tier ratio, hits / ``queried_blocks`` (blocks kvtier was
    asked about: those past each prompt's engine hit); ``offered_blocks`` are
    the trace's prompt blocks (``us_per_key`` is manager time per prompt block)
    and ``kvtier_offered_blocks`` the blocks offered to kvtier;
    ``gpu_hit_ratio`` = ``gpu_hit_blocks`` / prompt blocks; ``combined_hit_ratio``
    = (engine + kvtier hits) / prompt blocks. ``driver`` is ``"behind-engine"``,
    or ``"bound"`` for OPT / infinite rows over the blocks kvtier is asked about.
    """

    gpu_blocks: int = 0
    gpu_hit_blocks: int = 0
    gpu_hit_ratio: float = 0.0
    queried_blocks: int = 0
    kvtier_offered_blocks: int = 0
    combined_hit_ratio: float = 0.0


class EngineFront:
    """The engine side of a replay: its prefix cache and the requests running in it.

    Owns a ``GpuPrefixCache`` and the ids of the requests holding its blocks,
    oldest first (at most ``concurrency``). A request is admitted once the
    cache has the free blocks it needs, finishing the oldest running ones
    first as needed; nothing else finishes a request early. The engine side
    never depends on kvtier, so its hits are the same whatever kvtier holds.
    Memory: the cache's O(``num_blocks``) and ``concurrency`` request ids.
    """

    def __init__(self, gpu_blocks: int, concurrency: int = 1) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        self.cache = GpuPrefixCache(gpu_blocks)
        self.concurrency = concurrency
        self._running: deque[str] = deque()

    def admit(self, req_id: str, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        """Start ``req_id``; return its engine hit in blocks and the requests
        that finished before it started, in finishing order.

        ``GpuPrefixCache.allocate``'s errors pass through (a request longer
        than the whole cache raises ``EngineCacheFullError``).
        """
        cache, running = self.cache, self._running
        finished = []
        if len(running) >= self.concurrency:
            finished.append(self._finish_oldest())
        hits = cache.match(keys)  # finishing frees blocks but uncaches none
        while running and cache.blocks_needed(keys, hits) > cache.free_blocks:
            finished.append(self._finish_oldest())
        cache.allocate(req_id, keys, hits)
        running.append(req_id)
        return hits, finished

    def drain(self) -> list[str]:
        """Finish every running request, oldest first; return their ids."""
        return [self._finish_oldest() for _ in range(len(self._running))]

    def _finish_oldest(self) -> str:
        req_id = self._running.popleft()
        self.cache.free(req_id)
        return req_id


def check_fits(requests: Sequence[list[bytes]], gpu_blocks: int) -> None:
    """``ValueError`` when some request has more blocks than the engine cache.

    vLLM could never schedule such a prompt.
    """
    longest = max(map(len, requests), default=0)
    if longest > gpu_blocks:
        raise ValueError(
            f"gpu_blocks={gpu_blocks} is smaller than the longest request "
            f"({longest} blocks): the engine could not run it")


def _connector_calls(mgr: OffloadManager, keys: list[bytes], engine_hits: int,
                     ctx: RequestContext) -> tuple[int, int]:
    """kvtier's calls for one request started with ``engine_hits`` engine hits,
    as vLLM's offloading connector makes them; return (kvtier hits, blocks offered)."""
    queried = keys[engine_hits:]
    hits = mgr.lookup(queried, ctx) if queried else 0
    if hits:
        loaded = queried[:hits]
        mgr.prepare_load(loaded, ctx)
        mgr.complete_load(loaded, ctx)
    offer = keys[engine_hits + hits:] if hits else keys
    if offer:
        out = mgr.prepare_store(offer, ctx)
        if out is not None and out.keys_to_store:
            mgr.complete_store(out.keys_to_store, ctx)
    return hits, len(offer)


def replay_behind_engine(
    requests: Sequence[list[bytes]],
    capacity: int,
    policy: str = "lru",
    *,
    gpu_blocks: int,
    concurrency: int = 1,
    store_threshold: int = 1,
    max_tracker_size: int = 64_000,
    block_bytes: int | None = None,
    progress: ProgressCallback | None = None,
) -> BehindEngineResult:
    """Replay ``requests`` (see ``trace_keys``) through a fresh manager of
    ``capacity`` blocks behind an engine cache of ``gpu_blocks`` blocks.

    Lease bounds as in ``replay``; only manager calls are timed. Raises
    ``ValueError`` for a request longer than the engine cache, an unknown
    policy or bad parameters.
    """
    check_fits(requests, gpu_blocks)
    front = EngineFront(gpu_blocks, concurrency)
    mgr = replay_manager(capacity, policy, store_threshold, max_tracker_size)
    contexts: dict[str, RequestContext] = {}
    hits = queried = offered = 0
    clock = time.perf_counter
    elapsed = 0.0
    for keys, ctx in request_contexts(requests, progress):
        engine_hits, finished = front.admit(ctx.req_id, keys)
        start = clock()
        for req_id in finished:
            mgr.on_request_finished(contexts.pop(req_id))
        kv_hits, n_offered = _connector_calls(mgr, keys, engine_hits, ctx)
        elapsed += clock() - start
        contexts[ctx.req_id] = ctx
        hits += kv_hits
        queried += len(keys) - engine_hits
        offered += n_offered
    start = clock()
    for req_id in front.drain():
        mgr.on_request_finished(contexts.pop(req_id))
    elapsed += clock() - start
    gpu = front.cache
    base = ReplayResult.from_manager(mgr, requests, hits, elapsed, block_bytes, policy=policy,
                                     driver="behind-engine", concurrency=concurrency)
    return BehindEngineResult(
        **{**base.to_dict(), "hit_ratio": _ratio(hits, queried)},
        **_engine_fields(gpu_blocks, gpu.hits, gpu.queries, hits, queried, offered),
    )


def engine_miss_streams(
    requests: Sequence[list[bytes]], gpu_blocks: int, concurrency: int = 1
) -> tuple[list[list[bytes]], int]:
    """Each request's blocks past its engine hit (what kvtier is asked about)
    and the engine hits in all, with no kvtier behind the engine."""
    check_fits(requests, gpu_blocks)
    front = EngineFront(gpu_blocks, concurrency)
    streams = []
    for i, keys in enumerate(requests):
        engine_hits, _ = front.admit(f"req-{i}", keys)
        streams.append(keys[engine_hits:])
    return streams, front.cache.hits


def behind_engine_bounds(
    requests: Sequence[list[bytes]],
    capacities: Iterable[int],
    *,
    gpu_blocks: int,
    concurrency: int = 1,
    opt: bool = True,
    infinite: bool = True,
    block_bytes: int | None = None,
) -> list[BehindEngineResult]:
    """OPT per capacity and the infinite cache over the blocks kvtier is asked
    about behind the engine cache (``bound_results`` on ``engine_miss_streams``).

    Block hits over those queries only: a cache behind the engine also sees
    offers of engine hits (requests without kvtier hits offer every block), which
    it could use to keep a block again, so these rows are the optimum of a
    cache that sees only the queries, not a strict bound on kvtier.
    """
    streams, gpu_hits = engine_miss_streams(requests, gpu_blocks, concurrency)
    prompt = sum(map(len, requests))
    rows = bound_results(streams, capacities, opt=opt, infinite=infinite,
                         block_bytes=block_bytes)
    out = []
    for row in rows:
        fields = {**row.to_dict(), "offered_blocks": prompt, "concurrency": concurrency}
        fields.update(_engine_fields(gpu_blocks, gpu_hits, prompt, row.hit_blocks,
                                     row.offered_blocks, 0))
        out.append(BehindEngineResult(**fields))
    return out


def _engine_fields(gpu_blocks: int, gpu_hits: int, prompt: int, kv_hits: int,
                   queried: int, offered: int) -> dict[str, Any]:
    """The ``BehindEngineResult`` fields beyond ``ReplayResult``'s."""
    return {
        "gpu_blocks": gpu_blocks,
        "gpu_hit_blocks": gpu_hits,
        "gpu_hit_ratio": _ratio(gpu_hits, prompt),
        "queried_blocks": queried,
        "kvtier_offered_blocks": offered,
        "combined_hit_ratio": _ratio(gpu_hits + kv_hits, prompt),
    }


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
