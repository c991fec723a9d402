"""vLLM's prefix cache in front of kvtier: the block-pool model
(kvtier.replay.gpu_cache), the engine models (kvtier.replay.engine_schedule),
the connector side (kvtier.replay.behind_engine) and ``kvtier replay --gpu-blocks``.

Worked examples use 32-token blocks; prompts end in a partial block unless
said otherwise."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from kvtier import OffloadManager, RequestContext
from kvtier.bench import serving
from kvtier.cli import main
from kvtier.replay import behind_engine, serving_trace
from kvtier.replay.behind_engine import (
    ENGINE_BLOCK_TOKENS,
    BehindEngineResult,
    behind_engine_bounds,
    check_fits,
    engine_miss_streams,
    replay_behind_engine,
    served_requests,
)
from kvtier.replay.driver import ReplayResult, trace_keys
from kvtier.replay.engine_schedule import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    FixedFront,
    SaturatedScheduler,
    ServedRequest,
    private_key,
)
from kvtier.replay.generate import generate
from kvtier.replay.gpu_cache import EngineCacheFullError, GpuPrefixCache
from kvtier.replay.trace import TraceRequest

BT = ENGINE_BLOCK_TOKENS


def k(i: int) -> bytes:
    """A block key (trace hash id ``i``, group 0)."""
    return trace_keys([TraceRequest(0, 1, 1, (i,))])[0][0]


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def sr(ids: Iterable[int], tail: int = 16, out: int = 1) -> ServedRequest:
    """A request of full blocks ``ids`` and a partial block of ``tail`` tokens."""
    keys = ks(*ids)
    return ServedRequest(keys, BT * len(keys) + tail, out)


def run(cache: GpuPrefixCache, req_id: str, keys: list[bytes], tail: int = 0) -> int:
    """Start a request on its engine hit, hold and cache its full blocks (plus one
    partial block when ``tail``); return the hit."""
    hits = cache.match(keys, len(keys))
    cache.start(req_id, keys, hits)
    cache.grow(req_id, len(keys) + (1 if tail else 0))
    cache.commit(req_id, keys)
    return hits


# -- the block pool ---------------------------------------------------------------


def test_finished_request_is_evicted_tail_first_after_older_ones() -> None:
    cache = GpuPrefixCache(6)
    run(cache, "a", ks(1, 2, 3))
    cache.free("a")
    assert cache.free_order() == [None, None, None, k(3), k(2), k(1)]
    run(cache, "b", ks(4, 5))  # takes the two never-used blocks: no eviction
    cache.free("b")
    assert cache.free_order() == [None, k(3), k(2), k(1), k(5), k(4)]
    assert cache.evictions == 0
    run(cache, "c", ks(6, 7))  # the never-used block, then a's tail
    assert cache.evictions == 1
    assert not cache.contains(k(3))
    assert all(cache.contains(x) for x in ks(1, 2, 4, 5, 6, 7))
    assert cache.free_order() == [k(2), k(1), k(5), k(4)]


def test_a_freed_block_without_hash_goes_to_the_front() -> None:
    # BlockPool.free_blocks: prepend_n for blocks without hash, append_n for cached ones
    cache = GpuPrefixCache(4)
    run(cache, "a", ks(1))
    cache.free("a")
    run(cache, "b", ks(2), tail=5)  # a full block and a partial one, both never used
    assert cache.free_order() == [None, k(1)]
    cache.free("b")
    assert cache.free_order() == [None, None, k(1), k(2)]  # b's partial block first
    run(cache, "c", ks(3, 4))  # reuses both empty blocks: nothing evicted
    assert cache.evictions == 0 and cache.contains(k(1)) and cache.contains(k(2))


def test_running_requests_blocks_are_not_evictable() -> None:
    cache = GpuPrefixCache(4)
    run(cache, "a", ks(1, 2))
    run(cache, "b", ks(3, 4))
    assert cache.free_blocks == 0
    with pytest.raises(EngineCacheFullError, match="needs 1 free engine blocks, 0 of 4"):
        run(cache, "c", ks(5))
    assert all(cache.contains(x) for x in ks(1, 2, 3, 4)) and cache.running == 3
    cache.free("c")  # started on no hit, holds nothing
    cache.free("a")
    run(cache, "c", ks(5))  # evicts a's tail, never b's blocks
    assert not cache.contains(k(2))
    assert all(cache.contains(x) for x in ks(1, 3, 4, 5))


def test_a_hit_takes_a_free_block_out_of_the_queue() -> None:
    cache = GpuPrefixCache(4)
    run(cache, "a", ks(1, 2, 3))
    cache.free("a")
    assert cache.free_order() == [None, k(3), k(2), k(1)]
    assert cache.match(ks(1, 2, 9), 2) == 2
    assert cache.admission_cost(ks(1, 2, 9), 2, 3) == 3  # 1 new, 2 free hits
    run(cache, "b", ks(1, 2, 9))
    assert cache.free_order() == [k(3)]  # hits left the queue; 9 took the empty block
    cache.free("b")
    assert cache.free_order() == [k(3), k(9), k(2), k(1)]  # reused blocks rejoin at b's age
    run(cache, "c", ks(5))
    assert not cache.contains(k(3)) and cache.contains(k(1))


def test_hits_shared_by_running_requests_free_with_the_last_holder() -> None:
    cache = GpuPrefixCache(4)
    run(cache, "a", ks(1, 2))
    assert run(cache, "b", ks(1, 3)) == 1  # block 1 held twice
    assert cache.admission_cost(ks(1, 4), 1, 2) == 1  # a held hit costs no free block
    cache.free("a")
    assert cache.free_order() == [None, k(2)]
    cache.free("b")
    assert cache.free_order() == [None, k(2), k(3), k(1)]


def test_the_hit_cap_and_duplicate_blocks() -> None:
    cache = GpuPrefixCache(5)
    run(cache, "a", ks(1, 2))
    cache.free("a")
    # an aligned 64-token prompt may hit (64 - 1) // 32 = 1 block: its last is recomputed
    assert cache.match(ks(1, 2), (64 - 1) // BT) == 1
    assert cache.match(ks(1, 2, 3), 3) == 2
    assert cache.match(ks(1), 0) == 0 and cache.match([], 5) == 0
    cache.start("b", ks(1, 2), 1)
    cache.grow("b", 2)
    cache.commit("b", ks(1, 2))  # block 2 recomputed into a second block under its key
    cache.free("b")
    assert cache.free_order() == [None, None, k(2), k(2), k(1)]
    run(cache, "c", ks(7, 8, 9))  # evicts one copy of 2: the other still hits
    assert cache.contains(k(2)) and cache.match(ks(1, 2, 3), 3) == 2


def test_a_block_is_hit_only_once_cached() -> None:
    # allocate_slots caches the blocks a step fills: a prefill's later chunks are
    # not hits yet
    cache = GpuPrefixCache(6)
    cache.start("a", ks(1, 2, 3), 0)
    cache.grow("a", 2)
    cache.commit("a", ks(1))  # first chunk: 48 tokens
    assert cache.match(ks(1, 2, 3), 3) == 1
    cache.grow("a", 3)
    cache.commit("a", ks(1, 2, 3))
    assert cache.match(ks(1, 2, 3, 4), 4) == 3 and cache.held("a") == 3


def test_bad_arguments() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
            GpuPrefixCache(bad)  # type: ignore[arg-type]
    cache = GpuPrefixCache(4)
    with pytest.raises(ValueError, match="not a prefix hit"):
        cache.start("a", ks(1, 2), 1)
    run(cache, "a", ks(1))
    with pytest.raises(ValueError, match="already running"):
        cache.start("a", ks(2), 0)
    with pytest.raises(ValueError, match="holds 1 blocks, cannot cache 2"):
        cache.commit("a", ks(1, 2))
    with pytest.raises(KeyError):
        cache.free("nope")


# -- the trace as served -------------------------------------------------------------


def test_served_requests_have_full_blocks_only() -> None:
    trace = [
        TraceRequest(0, 6758, 500, tuple(range(14))),  # 13 full blocks + 422 - 416 tokens
        TraceRequest(1, 2000, 3, (7,)),  # the client runs out of hash ids: one block
        TraceRequest(2, 300, 0, (8,)),  # a prompt shorter than a block
    ]
    a, b, c = served_requests(trace)
    assert (a.prompt_tokens, len(a.keys), a.output_tokens) == (6758 // 16, 6758 // 512, 8)
    assert a.keys == ks(*range(13))
    assert (b.prompt_tokens, b.keys, b.output_tokens) == (32, ks(7), 3)
    assert (c.prompt_tokens, c.keys, c.output_tokens) == (300 // 16, [], 1)
    with pytest.raises(ValueError, match="request 0 has no prompt tokens"):
        served_requests([TraceRequest(0, 100, 1, ())])


def test_the_lab_serves_the_trace_as_the_benchmark_does() -> None:
    assert ENGINE_BLOCK_TOKENS == serving.BLOCK_TOKENS
    settings = serving.BenchSettings(Path("m"), Path("o"))
    assert settings.output_cap == serving_trace.DEFAULT_OUTPUT_CAP


def test_engine_fits_its_longest_sequence_in_all_blocks_but_the_null_one() -> None:
    req = sr([1, 2], tail=0, out=8)  # 64 + 7 tokens: 3 blocks
    check_fits([req], 4)
    with pytest.raises(ValueError, match=r"gpu_blocks=3 \(2 usable\) is smaller than the "
                                         r"longest request \(3 blocks\)"):
        check_fits([req], 3)
    with pytest.raises(ValueError, match="gpu_blocks must be an int >= 2"):
        check_fits([req], 1)


# -- the connector's calls ------------------------------------------------------------


class Recording(OffloadManager):
    """A manager that logs the keys of each call, as trace hash ids."""

    calls: list[tuple[str, list[int]]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []

    def _log(self, what: str, keys: Iterable[bytes]) -> None:
        self.calls.append((what, [int.from_bytes(x[:8], "big") for x in keys]))

    def lookup(self, keys: Iterable[bytes], ctx: RequestContext) -> int:
        keys = list(keys)
        self._log("lookup", keys)
        return super().lookup(keys, ctx)

    def prepare_load(self, keys: Any, ctx: RequestContext) -> Any:
        self._log("load", keys)
        return super().prepare_load(keys, ctx)

    def prepare_store(self, keys: Any, ctx: RequestContext) -> Any:
        self._log("offer", keys)
        return super().prepare_store(keys, ctx)

    def on_request_finished(self, ctx: RequestContext) -> None:
        self.calls.append(("finish", [int(ctx.req_id.split("-")[1])]))
        super().on_request_finished(ctx)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[Recording]:
    made: list[Recording] = []

    def make(capacity: int, policy: str, store_threshold: int,
             max_tracker_size: int) -> OffloadManager:
        mgr = Recording(capacity, policy=policy, store_threshold=store_threshold,
                        max_tracker_size=max_tracker_size, max_leases_per_request=capacity,
                        max_leased_blocks=capacity)
        made.append(mgr)
        return mgr

    monkeypatch.setattr(behind_engine, "replay_manager", make)
    return made


WORKED = [[1, 2, 3], [1, 2, 4], [5, 6, 7], [1, 2, 3, 8], [1, 2, 3, 8]]
"""Each with a 16-token partial block, one output token. Engine of 6 blocks (5
usable), kvtier of 10, one at a time: engine hits 0, 2, 0, 1, 4 blocks; kvtier
hits 0, 0, 0, 2, 0."""


def test_worked_example_calls(recording: list[Recording]) -> None:
    r = replay_behind_engine([sr(c) for c in WORKED], 10, gpu_blocks=6)
    (mgr,) = recording
    assert mgr.calls == [
        ("lookup", [1, 2, 3]), ("offer", [1, 2, 3]),  # all missed: all offered
        ("finish", [0]),  # vLLM steps once more after a finish: heard of before request 1
        ("lookup", [4]), ("offer", [1, 2, 4]),  # engine hit 1, 2; no kvtier hit: all offered
        ("finish", [1]),
        ("lookup", [5, 6, 7]), ("offer", [5, 6, 7]),  # 4 empty or stale blocks: evicts 3, 4, 2
        ("finish", [2]),
        ("lookup", [2, 3, 8]), ("load", [2, 3]), ("offer", [8]),  # engine hit 1; kvtier 2, 3
        ("finish", [3]),  # (the offer comes a step after the load: tests/test_lab_fidelity.py)
        ("offer", [1, 2, 3, 8]),  # engine hit all 4 full blocks (the partial one is
        ("finish", [4]),          # recomputed, never looked up): nothing asked, all offered
    ]
    assert isinstance(r, BehindEngineResult) and r.driver == "behind-engine"
    # tokens: prompts 112 x 3 + 144 x 2; engine hits (0 + 2 + 0 + 1 + 4) x 32
    assert (r.prompt_tokens, r.gpu_hit_tokens, r.queried_tokens, r.hit_tokens) == (
        624, 224, 400, 64)
    assert r.hit_ratio == pytest.approx(64 / 400)
    assert r.gpu_hit_ratio == pytest.approx(224 / 624)
    assert r.combined_hit_ratio == pytest.approx(288 / 624)
    assert (r.offered_blocks, r.gpu_hit_blocks, r.queried_blocks, r.hit_blocks,
            r.kvtier_offered_blocks) == (17, 7, 10, 2, 14)
    assert (r.gpu_blocks, r.capacity, r.concurrency, r.stores, r.batch_tokens) == (
        6, 10, 1, 8, 0)


def test_queries_count_the_partial_blocks_tokens(recording: list[Recording]) -> None:
    # the 16-token tail is queried (num_tokens - local hit tokens) but never looked up
    r = replay_behind_engine([sr([1, 2]), sr([1, 2])], 10, gpu_blocks=100)
    assert recording[0].calls[-3:] == [("finish", [0]), ("offer", [1, 2]), ("finish", [1])]
    assert (r.queried_tokens, r.hit_tokens, r.gpu_hit_tokens) == (80 + 16, 0, 64)
    assert r.hit_ratio == 0.0 and r.combined_hit_ratio == pytest.approx(64 / 160)


def test_a_repeated_aligned_prompt_loads_its_last_block_from_kvtier(
        recording: list[Recording]) -> None:
    # vLLM's engine recomputes the last block of a fully cached aligned prompt, but
    # its connector looks it up (up to num_tokens) and loads it from the CPU tier
    reqs = [sr([1, 2, 3], tail=0), sr([1, 2, 3], tail=0)]
    r = replay_behind_engine(reqs, 100, gpu_blocks=1000)
    assert recording[0].calls[-4:] == [("finish", [0]), ("lookup", [3]), ("load", [3]),
                                       ("finish", [1])]
    assert (r.gpu_hit_tokens, r.hit_tokens, r.queried_tokens) == (64, 32, 96 + 32)
    assert r.combined_hit_ratio == 0.5  # 96 of 192 tokens: 64 engine + 32 kvtier


def test_decode_fills_a_private_block_that_takes_room_at_the_back() -> None:
    # 60 prompt tokens and 8 output: 67 computed tokens fill the partial block
    # (cached, under a key only this request has) and start a third one
    cache = GpuPrefixCache(3)
    reqs = [sr([1], tail=28, out=8)]
    counts = FixedFront(cache, BT, behind_engine.QueryRecorder(reqs, BT)).run(reqs)
    assert cache.free_order() == [None, private_key(0, 1), k(1)]
    assert counts.hit_blocks == 0 and cache.evictions == 0
    # the next request reuses the empty block first, then evicts the private one
    run(cache, "b", ks(9, 10))
    assert cache.evictions == 1 and cache.contains(k(1))
    assert not cache.contains(private_key(0, 1))


def test_fixed_front_finishes_the_oldest_first_when_blocks_are_needed(
        recording: list[Recording]) -> None:
    # 5 usable blocks, 3 in flight, aligned prompts; r0 and r1 share block 1 (3
    # blocks held), r2 needs 4: r0 leaving frees block 2 only (1 is r1's too), so r1
    # leaves as well
    reqs = [sr([1, 2], tail=0), sr([1, 3], tail=0), sr([4, 5, 6, 9], tail=0),
            sr([7], tail=0)]
    r = replay_behind_engine(reqs, 10, gpu_blocks=6, concurrency=3)
    assert recording[0].calls == [
        ("lookup", [1, 2]), ("offer", [1, 2]),
        ("lookup", [3]), ("offer", [1, 3]),  # engine hit on r0's running block 1
        ("lookup", [4, 5, 6, 9]), ("offer", [4, 5, 6, 9]),
        ("finish", [0]), ("finish", [1]),  # r2 needed their blocks
        ("lookup", [7]), ("offer", [7]),  # one block free: nobody leaves
        ("finish", [2]), ("finish", [3]),
    ]
    assert r.concurrency == 3 and r.gpu_hit_blocks == 1 and r.max_running == 2
    with pytest.raises(ValueError, match="concurrency"):
        replay_behind_engine(reqs, 10, gpu_blocks=6, concurrency=0)


def test_engine_hits_do_not_depend_on_kvtier_with_a_fixed_number_in_flight() -> None:
    chat = served_requests(generate("chat", seed=5, requests=300))
    rows = [replay_behind_engine(chat, c, p, gpu_blocks=200, store_threshold=t, concurrency=n)
            for p in ("lru", "arc") for c in (50, 500) for t in (1, 2) for n in (1, 4)]
    for n in (1, 4):
        streams, counts, query_tokens = engine_miss_streams(chat, 200, n)
        mine = [r for r in rows if r.concurrency == n]
        assert {r.gpu_hit_tokens for r in mine} == {counts.hit_tokens}
        assert {r.queried_tokens for r in mine} == {query_tokens}
        assert {r.queried_blocks for r in mine} == {sum(map(len, streams))}
    assert len({r.hit_blocks for r in rows}) > 1


def test_a_big_engine_cache_leaves_kvtier_only_what_it_loses() -> None:
    chat = served_requests(generate("chat", seed=3, requests=400))
    longest = max(behind_engine.sequence_blocks(r, BT) for r in chat)
    small = replay_behind_engine(chat, 300, "lru", gpu_blocks=longest + 1)
    huge = replay_behind_engine(chat, 300, "lru", gpu_blocks=100_000)
    assert small.offered_blocks == huge.offered_blocks == sum(len(r.keys) for r in chat)
    for r in (small, huge):
        assert r.queried_tokens == r.prompt_tokens - r.gpu_hit_tokens
        assert r.combined_hit_ratio == pytest.approx(
            (r.gpu_hit_tokens + r.hit_tokens) / r.prompt_tokens)
    assert 0 < small.hit_ratio < 1 and huge.gpu_hit_tokens > small.gpu_hit_tokens


# -- vLLM's scheduler over a saturated queue ----------------------------------------


def saturated(reqs: list[ServedRequest], gpu_blocks: int, batch_tokens: int,
              capacity: int = 10) -> BehindEngineResult:
    return replay_behind_engine(reqs, capacity, gpu_blocks=gpu_blocks,
                                batch_tokens=batch_tokens)


def test_scheduler_chunks_prefills_and_admits_in_the_budget_left(
        recording: list[Recording]) -> None:
    # 8 usable blocks, 64 tokens a step. r0 (136 tokens, 2 out) prefills in 3 steps;
    # r1 (104) is admitted in the 56 tokens left at step 3, hitting r0's running
    # blocks 1, 2; r2 (40) does not fit then (1 free block for 2) and is asked
    # about again at step 4, where it fits in r1's freed blocks
    reqs = [sr([1, 2, 3, 4], tail=8, out=2), sr([1, 2, 5], tail=8), sr([6], tail=8)]
    r = saturated(reqs, 9, 64)
    assert recording[0].calls == [
        ("lookup", [1, 2, 3, 4]), ("offer", [1, 2]),  # step 1: the first chunk's blocks
        ("offer", [3, 4]),  # step 2
        ("lookup", [5]), ("lookup", [6]),  # step 3: r1 admitted, r2 does not fit
        ("offer", [1, 2, 5]),
        ("lookup", [6]), ("offer", [6]),  # step 4: r0 decodes, r2 admitted
        ("finish", [1]),  # r1 finished at step 3: kvtier hears of it at step 4
        ("finish", [0]), ("finish", [2]),
    ]
    assert (r.prompt_tokens, r.gpu_hit_tokens, r.queried_tokens) == (280, 64, 216)
    # running after each step (the gauge): r0; r0; r0 (r1 done); none
    assert (r.concurrency, r.batch_tokens, r.mean_running, r.max_running) == (0, 64, 0.75, 1)
    assert r.preemptions == 0


def test_scheduler_admits_a_whole_prompt_or_waits_asking_again(
        recording: list[Recording]) -> None:
    # 5 usable blocks, 64 tokens a step: r1's first chunk (2 blocks) would fit next
    # to r0's 3 blocks, its prompt (4 blocks) does not: it waits until r0 is gone,
    # and the connector is asked about it at every step it waits
    reqs = [sr([1, 2], tail=8, out=2), sr([3, 4, 5], tail=8)]
    r = saturated(reqs, 6, 64)
    assert recording[0].calls == [
        ("lookup", [1, 2]), ("offer", [1, 2]),  # step 1: r0's first chunk
        ("lookup", [3, 4, 5]),  # step 2: r0's last 8 tokens; r1 does not fit
        ("lookup", [3, 4, 5]),  # step 3: r0 decodes; r1 does not fit
        ("lookup", [3, 4, 5]), ("offer", [3, 4]), ("finish", [0]),  # step 4
        ("offer", [5]),  # step 5
        ("finish", [1]),
    ]
    assert (r.queried_tokens, r.mean_running, r.max_running) == (72 + 104, 3 / 5, 1)


def test_scheduler_admits_a_load_whose_blocks_fit_past_the_prefills_in_flight(
        recording: list[Recording]) -> None:
    # 8 usable blocks. r0, r1 run together, r2 (8 blocks) evicts all their blocks;
    # r3 and r4 then hit kvtier. r3 loads and will need 2 more blocks; r4's whole
    # sequence (5 blocks) fits the 6 free ones and its load (2 blocks) fits what
    # r3 leaves (_inflight_prefill_reserved_blocks): both load in one step, as
    # vLLM 0.32's Scheduler does (tests/test_lab_fidelity_saturated.py)
    reqs = [sr([1, 2], tail=8), sr([3, 4], tail=8), sr(range(9, 16), tail=8),
            sr([1, 2, 7], tail=8), sr([3, 4, 16, 17], tail=8)]
    saturated(reqs, 9, CPU_MAX_NUM_BATCHED_TOKENS, capacity=20)
    filler = list(range(9, 16))
    assert recording[0].calls == [
        ("lookup", [1, 2]), ("lookup", [3, 4]), ("lookup", filler),  # step 1
        ("offer", [1, 2]), ("offer", [3, 4]),
        ("lookup", filler), ("lookup", [1, 2, 7]), ("offer", filler),  # step 2
        ("finish", [0]), ("finish", [1]),
        ("lookup", [1, 2, 7]), ("load", [1, 2]),  # step 3: both load
        ("lookup", [3, 4, 16, 17]), ("load", [3, 4]), ("finish", [2]),
        ("offer", [7]), ("offer", [16, 17]),  # step 4: both compute
        ("finish", [3]), ("finish", [4]),
    ]


def test_scheduler_loads_kvtier_hits_a_step_before_computing(
        recording: list[Recording]) -> None:
    # 4 usable blocks: r0 and r1 (3 blocks each) run one after the other; r1's
    # blocks evict r0's block 2. r2 hits block 1 in the engine and block 2 in
    # kvtier, waits for room (asked again), loads block 2 in its admission step,
    # computes in the next and offers only what it computed: block 6
    reqs = [sr([1, 2], tail=8), sr([3, 4], tail=8), sr([1, 2, 6], tail=8)]
    r = saturated(reqs, 5, CPU_MAX_NUM_BATCHED_TOKENS)
    assert recording[0].calls == [
        ("lookup", [1, 2]), ("lookup", [3, 4]), ("offer", [1, 2]),  # step 1
        ("lookup", [3, 4]), ("lookup", [2, 6]), ("offer", [3, 4]), ("finish", [0]),
        ("lookup", [2, 6]), ("load", [2]), ("finish", [1]),  # step 3: load only
        ("offer", [6]),  # step 4
        ("finish", [2]),
    ]
    assert (r.queried_tokens, r.hit_tokens, r.hit_blocks) == (216, 32, 1)
    assert r.hit_ratio == pytest.approx(32 / 216)


def test_scheduler_preempts_the_last_running_request_for_a_decode_block() -> None:
    # 4 usable blocks, both prompts fit (2 blocks each); r0's third decode step
    # needs a third block: r1 (admitted last) is preempted, resumed later on its own
    # cached block 2, and counted apart (not in the metrics)
    reqs = [sr([1], tail=30, out=4), sr([2], tail=8, out=8)]
    streams, counts, query_tokens = engine_miss_streams(reqs, 5, batch_tokens=2048)
    assert counts.preemptions == 1
    assert streams == [ks(1), ks(2)]  # first admissions only
    assert (counts.query_tokens, counts.hit_tokens, query_tokens) == (62 + 40, 0, 102)
    r = saturated(reqs, 5, 2048)
    assert (r.preemptions, r.queried_tokens, r.gpu_hit_tokens) == (1, 102, 0)


def test_scheduler_never_exceeds_its_blocks_and_counts_every_request() -> None:
    chat = served_requests(generate("chat", seed=7, requests=400))
    longest = max(behind_engine.sequence_blocks(r, BT) for r in chat)
    engine = SaturatedScheduler(GpuPrefixCache(longest), BT,
                                behind_engine.QueryRecorder(chat, BT), 512)
    counts = engine.run(chat)
    assert counts.query_tokens == sum(r.prompt_tokens for r in chat)
    assert engine.cache.free_blocks == longest and engine.cache.running == 0
    assert 1 < counts.mean_running < counts.max_running
    r = replay_behind_engine(chat, 300, gpu_blocks=longest + 1, batch_tokens=512)
    assert r.queried_tokens == r.prompt_tokens - r.gpu_hit_tokens and 0 < r.hit_ratio < 1


def test_bounds_over_the_blocks_kvtier_is_asked_about() -> None:
    opt, inf = behind_engine_bounds([sr(c) for c in WORKED], [10], gpu_blocks=6)
    # kvtier's queries: [1 2 3] [4] [5 6 7] [2 3 8] []: 2 and 3 again
    assert (opt.policy, opt.driver, opt.hit_blocks, opt.queried_blocks) == ("opt", "bound", 2, 10)
    assert opt.hit_ratio == pytest.approx(64 / 400)
    assert opt.combined_hit_ratio == pytest.approx(288 / 624)
    assert (inf.policy, inf.capacity, inf.hit_blocks) == ("infinite", 8, 2)
    (tight,) = behind_engine_bounds([sr(c) for c in WORKED], [1], gpu_blocks=6,
                                    infinite=False)
    assert tight.hit_blocks < 2


def test_result_dict_has_every_field() -> None:
    d = replay_behind_engine([sr([1, 2])], 4, gpu_blocks=4).to_dict()
    assert list(d) == list(BehindEngineResult.__dataclass_fields__)
    assert set(ReplayResult.__dataclass_fields__) < set(d)


# -- the command line ------------------------------------------------------------------


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """WORKED as a Mooncake trace: 512-token blocks and a 256-token tail
    (served: 32-token blocks and a 16-token tail)."""
    path = tmp_path / "worked.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(c) + 256, "output_length": 1,
                    "hash_ids": [*c, 100 + i]}) + "\n" for i, c in enumerate(WORKED)))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_rows(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "10,1",
                          "--policy", "lru,arc", "--gpu-blocks", "6", "--json", "--bounds")
    assert code == 0 and err == ""
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        ("lru", 10), ("lru", 1), ("arc", 10), ("arc", 1), ("opt", 10), ("opt", 1),
        ("infinite", 8)]
    first = rows[0]
    assert (first["gpu_blocks"], first["hit_blocks"], first["queried_blocks"],
            first["gpu_hit_blocks"], first["driver"]) == (6, 2, 10, 7, "behind-engine")
    assert (first["queried_tokens"], first["hit_tokens"], first["prompt_tokens"]) == (
        400, 64, 624)
    assert first["hit_ratio"] == pytest.approx(64 / 400)
    assert first["gpu_hit_ratio"] == pytest.approx(224 / 624)
    assert first["combined_hit_ratio"] == pytest.approx(288 / 624)
    assert all(r["gpu_blocks"] == 6 and r["trace"] == str(trace) for r in rows)


def test_cli_table(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                        "--gpu-blocks", "6", "--store-threshold", "1,2", "--no-progress")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["policy", "capacity", "threshold", "cpu-tier", "hit", "engine",
                              "hit", "combined", "stores", "evictions", "us/key"]
    assert len({len(line) for line in out.splitlines()}) == 1
    assert rows[0].split()[:6] == ["lru", "10", "1", "0.1600", "0.3590", "0.4615"]
    assert len(rows) == 2


def test_cli_limit_requests_concurrency_and_scheduler(capsys: pytest.CaptureFixture[str],
                                                      trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                        "--gpu-blocks", "6", "--json", "--limit-requests", "2")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and (row["requests"], row["gpu_hit_blocks"]) == (2, 2)
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                        "--gpu-blocks", "12", "--json", "--driver", "engine",
                        "--concurrency", "2")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and row["concurrency"] == 2 and row["driver"] == "behind-engine"
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                        "--gpu-blocks", "12", "--json", "--gpu-batch-tokens", "64")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and (row["batch_tokens"], row["concurrency"]) == (64, 0)
    assert row["max_running"] >= 1


@pytest.mark.parametrize(("extra", "message"), [
    (["--gpu-blocks", "5"],
     "kvtier: error: --gpu-blocks 5: gpu_blocks=5 (4 usable) is smaller than the longest "
     "request (5 blocks): the engine could not run it"),
    (["--gpu-blocks", "1"],
     "kvtier: error: --gpu-blocks 1: gpu_blocks must be an int >= 2 (one is vLLM's null "
     "block), got 1"),
    (["--gpu-blocks", "6", "--disk-blocks", "10"],
     "kvtier: error: --gpu-blocks cannot be combined with --disk-blocks"),
    (["--gpu-blocks", "6", "--driver", "engine", "--preempt", "0.5"],
     "kvtier: error: --gpu-blocks does not take --preempt (the scheduler model of "
     "--gpu-batch-tokens preempts as vLLM does)"),
    (["--gpu-batch-tokens", "64"], "kvtier: error: --gpu-batch-tokens needs --gpu-blocks"),
    (["--gpu-blocks", "6", "--gpu-batch-tokens", "64", "--driver", "engine"],
     "kvtier: error: --gpu-batch-tokens sets the requests in flight itself "
     "(no --driver engine / --concurrency)"),
])
def test_cli_errors(capsys: pytest.CaptureFixture[str], trace: Path, extra: list[str],
                    message: str) -> None:
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                          *extra)
    assert (code, out, err.strip()) == (2, "", message)


@pytest.mark.parametrize("value", ["0", "-3", "x"])
@pytest.mark.parametrize("option", ["--gpu-blocks", "--gpu-batch-tokens"])
def test_cli_bad_gpu_numbers_are_usage_errors(capsys: pytest.CaptureFixture[str],
                                              trace: Path, option: str, value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--capacity", "10", "--policy", "lru", option, value])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err
