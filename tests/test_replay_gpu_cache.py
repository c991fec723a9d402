"""vLLM's prefix cache in front of kvtier: the engine-cache model
(kvtier.replay.gpu_cache), the behind-engine driver (kvtier.replay.behind_engine)
and ``kvtier replay --gpu-blocks``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from kvtier import OffloadManager, RequestContext
from kvtier.cli import main
from kvtier.replay import behind_engine
from kvtier.replay.behind_engine import (
    BehindEngineResult,
    EngineFront,
    behind_engine_bounds,
    engine_miss_streams,
    replay_behind_engine,
)
from kvtier.replay.driver import ReplayResult, replay, trace_keys
from kvtier.replay.generate import generate
from kvtier.replay.gpu_cache import EngineCacheFullError, GpuPrefixCache
from kvtier.replay.trace import TraceRequest


def k(i: int) -> bytes:
    """A block key (trace hash id ``i``, group 0)."""
    return trace_keys([TraceRequest(0, 1, 1, (i,))])[0][0]


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def chains(*ids: Iterable[int]) -> list[list[bytes]]:
    return trace_keys([TraceRequest(i, 1, 1, tuple(c)) for i, c in enumerate(ids)])


def run(cache: GpuPrefixCache, req_id: str, keys: list[bytes]) -> int:
    """Allocate a request with its engine hit; return the hit."""
    hits = cache.match(keys)
    cache.allocate(req_id, keys, hits)
    return hits


# -- the engine-cache model --------------------------------------------------------


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


def test_running_requests_blocks_are_not_evictable() -> None:
    cache = GpuPrefixCache(4)
    run(cache, "a", ks(1, 2))
    run(cache, "b", ks(3, 4))
    assert cache.free_blocks == 0
    with pytest.raises(EngineCacheFullError, match="needs 1 free engine blocks, 0 of 4"):
        run(cache, "c", ks(5))
    assert all(cache.contains(x) for x in ks(1, 2, 3, 4)) and cache.running == 2
    cache.free("a")
    run(cache, "c", ks(5))  # evicts a's tail, never b's blocks
    assert not cache.contains(k(2))
    assert all(cache.contains(x) for x in ks(1, 3, 4, 5))


def test_a_hit_takes_a_free_block_out_of_the_queue() -> None:
    cache = GpuPrefixCache(4)
    run(cache, "a", ks(1, 2, 3))
    cache.free("a")
    assert cache.free_order() == [None, k(3), k(2), k(1)]
    assert cache.match(ks(1, 2, 9)) == 2
    assert cache.blocks_needed(ks(1, 2, 9), 2) == 3  # 1 new, 2 free hits
    run(cache, "b", ks(1, 2, 9))
    assert cache.free_order() == [k(3)]  # hits left the queue; 9 took the empty block
    cache.free("b")
    assert cache.free_order() == [k(3), k(9), k(2), k(1)]  # reused blocks rejoin at b's age
    run(cache, "c", ks(5))
    assert not cache.contains(k(3)) and cache.contains(k(1))
    assert (cache.hits, cache.queries) == (2, 7)


def test_hits_shared_by_running_requests_free_with_the_last_holder() -> None:
    cache = GpuPrefixCache(4)
    run(cache, "a", ks(1, 2))
    assert run(cache, "b", ks(1, 3)) == 1  # block 1 held twice
    cache.free("a")
    assert cache.free_order() == [None, k(2)]
    cache.free("b")
    assert cache.free_order() == [None, k(2), k(3), k(1)]


def test_last_block_of_a_fully_cached_prompt_is_recomputed() -> None:
    cache = GpuPrefixCache(5)
    run(cache, "a", ks(1, 2))
    cache.free("a")
    assert cache.match(ks(1, 2)) == 1  # never the whole prompt
    assert cache.match(ks(1, 2, 3)) == 2
    assert cache.match(ks(1)) == 0 and cache.match([]) == 0
    run(cache, "b", ks(1, 2))  # block 2 recomputed into a second block under its key
    cache.free("b")
    assert cache.free_order() == [None, None, k(2), k(2), k(1)]
    run(cache, "c", ks(7, 8, 9))  # evicts one copy of 2: the other still hits
    assert cache.contains(k(2)) and cache.match(ks(1, 2, 3)) == 2


def test_bad_arguments() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
            GpuPrefixCache(bad)  # type: ignore[arg-type]
    cache = GpuPrefixCache(4)
    with pytest.raises(ValueError, match="not a prefix hit"):
        cache.allocate("a", ks(1, 2), 1)
    run(cache, "a", ks(1))
    with pytest.raises(ValueError, match="already running"):
        cache.allocate("a", ks(2), 0)
    with pytest.raises(KeyError):
        cache.free("nope")


def test_engine_front_finishes_oldest_first_when_blocks_are_needed() -> None:
    front = EngineFront(4, concurrency=3)
    assert front.admit("r0", ks(1, 2)) == (0, [])
    assert front.admit("r1", ks(1, 3)) == (1, [])  # shares block 1 with r0
    # 3 blocks held, 1 free: r2 needs 3, so r0 then r1 finish first
    assert front.admit("r2", ks(4, 5, 6)) == (0, ["r0", "r1"])
    assert front.admit("r3", ks(7)) == (0, [])
    assert front.drain() == ["r2", "r3"]
    one = EngineFront(10, concurrency=1)
    one.admit("a", ks(1))
    assert one.admit("b", ks(1, 2)) == (1, ["a"])  # one at a time
    with pytest.raises(ValueError, match="concurrency"):
        EngineFront(4, concurrency=0)


# -- the driver: which keys kvtier is asked about and offered ------------------------


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
"""Engine cache of 4 blocks, kvtier of 10: engine hits 0, 2, 0, 1, 3; kvtier hits 0, 0, 0, 2, 1."""


def test_worked_example_calls(recording: list[Recording]) -> None:
    r = replay_behind_engine(chains(*WORKED), 10, gpu_blocks=4)
    (mgr,) = recording
    assert mgr.calls == [
        ("lookup", [1, 2, 3]), ("offer", [1, 2, 3]),  # all missed: all offered
        ("finish", [0]),
        ("lookup", [4]), ("offer", [1, 2, 4]),  # engine hit 1, 2; no kvtier hit: all offered
        ("finish", [1]),
        ("lookup", [5, 6, 7]), ("offer", [5, 6, 7]),  # evicts 3, 4 and 2 from the engine
        ("finish", [2]),
        ("lookup", [2, 3, 8]), ("load", [2, 3]), ("offer", [8]),  # engine hit 1; kvtier 2, 3
        ("finish", [3]),
        ("lookup", [8]), ("load", [8]),  # engine hit 1, 2, 3 (not the last block): nothing
        ("finish", [4]),                 # left to offer
    ]
    assert isinstance(r, BehindEngineResult) and r.driver == "behind-engine"
    assert (r.offered_blocks, r.gpu_hit_blocks, r.queried_blocks, r.hit_blocks,
            r.kvtier_offered_blocks) == (17, 6, 11, 3, 10)
    assert r.hit_ratio == pytest.approx(3 / 11)
    assert r.gpu_hit_ratio == pytest.approx(6 / 17)
    assert r.combined_hit_ratio == pytest.approx(9 / 17)
    assert (r.gpu_blocks, r.capacity, r.concurrency, r.stores) == (4, 10, 1, 8)


def test_concurrent_requests_finish_when_they_leave_the_engine(
        recording: list[Recording]) -> None:
    r = replay_behind_engine(chains([1, 2], [1, 3], [4, 5, 6]), 10, gpu_blocks=4,
                             concurrency=3)
    (mgr,) = recording
    assert mgr.calls == [
        ("lookup", [1, 2]), ("offer", [1, 2]),
        ("lookup", [3]), ("offer", [1, 3]),  # engine hit on r0's running block 1
        ("finish", [0]), ("finish", [1]),  # r2 needs their blocks
        ("lookup", [4, 5, 6]), ("offer", [4, 5, 6]),
        ("finish", [2]),
    ]
    assert r.concurrency == 3 and r.gpu_hit_blocks == 1


def test_without_an_engine_cache_in_the_way_it_is_the_sequential_lab() -> None:
    # engine cache of one request's blocks, each request's prefix evicted by the one
    # before: kvtier sees what the lab sees, bar each request's own engine hits
    chat = trace_keys(generate("chat", seed=3, requests=400))
    longest = max(map(len, chat))
    lab = replay(chat, 300, "lru")
    behind = replay_behind_engine(chat, 300, "lru", gpu_blocks=longest)
    assert behind.offered_blocks == lab.offered_blocks
    assert behind.queried_blocks == behind.offered_blocks - behind.gpu_hit_blocks
    assert behind.combined_hit_ratio == pytest.approx(
        (behind.gpu_hit_blocks + behind.hit_blocks) / behind.offered_blocks)
    assert 0 < behind.hit_ratio < 1 and behind.gpu_hit_ratio > 0


def test_engine_hits_do_not_depend_on_kvtier() -> None:
    chat = trace_keys(generate("chat", seed=5, requests=300))
    rows = [replay_behind_engine(chat, c, p, gpu_blocks=200, store_threshold=t)
            for p in ("lru", "arc") for c in (50, 500) for t in (1, 2)]
    streams, gpu_hits = engine_miss_streams(chat, 200)
    assert {r.gpu_hit_blocks for r in rows} == {gpu_hits}
    assert {r.queried_blocks for r in rows} == {sum(map(len, streams))}
    assert len({r.hit_blocks for r in rows}) > 1


PREFIX_REUSE = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [1, 2, 4, 6], [1, 2, 3, 5, 7], [9, 1]]
"""Reuse of prefixes only: every request ends in a block never seen before."""


def test_huge_engine_cache_leaves_kvtier_no_hits() -> None:
    huge = replay_behind_engine(chains(*PREFIX_REUSE), 100, gpu_blocks=1000)
    assert (huge.hit_blocks, huge.hit_ratio) == (0, 0.0)
    assert huge.gpu_hit_blocks == 0 + 2 + 3 + 3 + 4 + 0
    assert huge.combined_hit_ratio == huge.gpu_hit_ratio
    small = replay_behind_engine(chains(*PREFIX_REUSE), 100, gpu_blocks=5)
    assert small.hit_blocks > 0 and small.gpu_hit_blocks < huge.gpu_hit_blocks


def test_a_repeated_prompt_loads_its_last_block_from_kvtier(
        recording: list[Recording]) -> None:
    # vLLM's engine recomputes the last block of a fully cached prompt, but its
    # connector looks it up (up to num_tokens) and loads it from the CPU tier
    r = replay_behind_engine(chains([1, 2, 3], [1, 2, 3]), 100, gpu_blocks=1000)
    assert recording[0].calls[-3:] == [("lookup", [3]), ("load", [3]), ("finish", [1])]
    assert (r.gpu_hit_blocks, r.hit_blocks, r.queried_blocks) == (2, 1, 4)
    assert r.combined_hit_ratio == 0.5  # 3 of 6 blocks: 2 engine + 1 kvtier


def test_request_longer_than_the_engine_cache_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gpu_blocks=2 is smaller than the longest "
                                         r"request \(3 blocks\)"):
        replay_behind_engine(chains([1], [1, 2, 3]), 10, gpu_blocks=2)
    r = replay_behind_engine(chains([1], [1, 2, 3]), 10, gpu_blocks=3)
    assert r.requests == 2


def test_bounds_over_the_blocks_kvtier_is_asked_about() -> None:
    opt, inf = behind_engine_bounds(chains(*WORKED), [10], gpu_blocks=4)
    # kvtier's queries: [1 2 3] [4] [5 6 7] [2 3 8] [8]: 2, 3 and 8 again
    assert (opt.policy, opt.driver, opt.hit_blocks, opt.queried_blocks) == ("opt", "bound", 3, 11)
    assert opt.hit_ratio == pytest.approx(3 / 11)
    assert opt.combined_hit_ratio == pytest.approx(9 / 17)
    assert (inf.policy, inf.capacity, inf.hit_blocks) == ("infinite", 8, 3)
    (tight,) = behind_engine_bounds(chains(*WORKED), [1], gpu_blocks=4, infinite=False)
    assert tight.hit_blocks < 3


def test_result_dict_has_every_field() -> None:
    d = replay_behind_engine(chains([1, 2]), 4, gpu_blocks=4).to_dict()
    assert list(d) == list(BehindEngineResult.__dataclass_fields__)
    assert set(ReplayResult.__dataclass_fields__) < set(d)


# -- the command line ------------------------------------------------------------------


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "worked.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(c), "output_length": 1,
                    "hash_ids": c}) + "\n" for i, c in enumerate(WORKED)))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_rows(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "10,1",
                          "--policy", "lru,arc", "--gpu-blocks", "4", "--json", "--bounds")
    assert code == 0 and err == ""
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        ("lru", 10), ("lru", 1), ("arc", 10), ("arc", 1), ("opt", 10), ("opt", 1),
        ("infinite", 8)]
    first = rows[0]
    assert (first["gpu_blocks"], first["hit_blocks"], first["queried_blocks"],
            first["gpu_hit_blocks"], first["driver"]) == (4, 3, 11, 6, "behind-engine")
    assert first["hit_ratio"] == pytest.approx(3 / 11)
    assert first["gpu_hit_ratio"] == pytest.approx(6 / 17)
    assert first["combined_hit_ratio"] == pytest.approx(9 / 17)
    assert all(r["gpu_blocks"] == 4 and r["trace"] == str(trace) for r in rows)


def test_cli_table(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                        "--gpu-blocks", "4", "--store-threshold", "1,2", "--no-progress")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["policy", "capacity", "threshold", "cpu-tier", "hit", "engine",
                              "hit", "combined", "stores", "evictions", "us/key"]
    assert len({len(line) for line in out.splitlines()}) == 1
    assert rows[0].split()[:6] == ["lru", "10", "1", "0.2727", "0.3529", "0.5294"]
    assert len(rows) == 2


def test_cli_limit_requests_and_concurrency(capsys: pytest.CaptureFixture[str],
                                            trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                        "--gpu-blocks", "4", "--json", "--limit-requests", "2")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and (row["requests"], row["gpu_hit_blocks"]) == (2, 2)
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                        "--gpu-blocks", "8", "--json", "--driver", "engine",
                        "--concurrency", "2")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and row["concurrency"] == 2 and row["driver"] == "behind-engine"


@pytest.mark.parametrize(("extra", "message"), [
    (["--gpu-blocks", "3"],
     "kvtier: error: --gpu-blocks 3: gpu_blocks=3 is smaller than the longest request "
     "(4 blocks): the engine could not run it"),
    (["--gpu-blocks", "4", "--disk-blocks", "10"],
     "kvtier: error: --gpu-blocks cannot be combined with --disk-blocks"),
    (["--gpu-blocks", "4", "--driver", "engine", "--preempt", "0.5"],
     "kvtier: error: --gpu-blocks does not model preemption (no --preempt)"),
])
def test_cli_errors(capsys: pytest.CaptureFixture[str], trace: Path, extra: list[str],
                    message: str) -> None:
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "10", "--policy", "lru",
                          *extra)
    assert (code, out, err.strip()) == (2, "", message)


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_cli_bad_gpu_blocks_is_a_usage_error(capsys: pytest.CaptureFixture[str], trace: Path,
                                            value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--capacity", "10", "--policy", "lru",
              "--gpu-blocks", value])
    assert exc.value.code == 2
    assert "--gpu-blocks" in capsys.readouterr().err
