"""``kvtier foresight`` and the hash-id caches under it say what they claim
(kvtier.replay.foresight, kvtier.replay.reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.hash_id_traces import chat_requests, shared_head_between_one_offs

from kvtier import block_key
from kvtier.cli import main
from kvtier.replay import foresight as fs
from kvtier.replay.driver import replay
from kvtier.replay.generate import generate, write_trace
from kvtier.replay.reference import LRUCache, prefix_hit_ratio
from kvtier.replay.trace import TraceRequest


def _write(requests: list[tuple[int, ...]], path: Path) -> Path:
    write_trace([TraceRequest(i, len(ids) * 512, 10, ids) for i, ids in enumerate(requests)],
                path)
    return path


@pytest.mark.parametrize("capacity", [40, 200])
def test_reference_lru_equals_the_managers_lru_replay(capacity: int) -> None:
    requests = chat_requests()
    mine = prefix_hit_ratio(requests, LRUCache(capacity))
    keys = [[block_key(h) for h in ids] for ids in requests]
    assert mine > 0
    assert mine == replay(keys, capacity, "lru").hit_ratio


def test_use_times_lists_each_request_once_in_order() -> None:
    assert dict(fs.use_times([(1, 2, 1), (2,), (3, 1)])) == {1: [0, 2], 2: [0, 1], 3: [2]}


def test_window_ranking_keeps_the_head_only_when_the_window_reaches_it() -> None:
    requests = shared_head_between_one_offs()  # the head comes back every third request
    uses = fs.use_times(requests)
    lru = prefix_hit_ratio(requests, LRUCache(4))
    # a window of three requests still counts the head's last use: the one-offs
    # only tie with it and are declined
    past = prefix_hit_ratio(requests, fs.WindowLFU(4, 3, uses, future=False))
    # the negative control: a window of one request sees the head at 0 uses
    blind = prefix_hit_ratio(requests, fs.WindowLFU(4, 1, uses, future=False))
    future = prefix_hit_ratio(requests, fs.WindowLFU(4, 3, uses, future=True))
    assert lru == blind == 0.0
    assert past == pytest.approx(3 * 99 / (11 * 100))
    assert future >= past


def test_window_ranking_stays_within_capacity() -> None:
    requests = chat_requests(seed=3, n=400)
    uses = fs.use_times(requests)
    for future in (False, True):
        cache = fs.WindowLFU(32, 50, uses, future)
        for ids in requests:
            cache.serve(ids)
            assert len(cache.last) <= 32
    with pytest.raises(ValueError, match="window"):
        fs.WindowLFU(32, 0, uses, False)


def test_reuse_table_counts_uses_again_within_the_horizon() -> None:
    # block 7 used at requests 0, 2, 3; block 8 once
    requests = [(7,), (9,), (7,), (7, 8)]
    table = fs.reuse_table(fs.use_times(requests), horizon=1)
    once, twice = fs.state(1, 0)[0], fs.state(2, 0)[0]
    # after one use: 7 (next gap 2) and 9, 8 (never) -> nothing within 1 request
    assert table[once, 0] == 0.0
    # ... but of those still unused one request on (7 only), all come back by 2
    assert table[once, fs.state(1, 1)[1]] == pytest.approx(1 / 3)  # 7 of 7, 9, 8
    # after its second use 7 comes back the next request (uses 2-3 share a class)
    assert table[twice, 0] == pytest.approx(1 / 2)  # the 2nd use's gap 1, the 3rd's never
    with pytest.raises(ValueError, match="horizon"):
        fs.reuse_table({}, 0)


def test_fitted_ranking_keeps_the_head_and_an_inverted_table_loses_it() -> None:
    requests = shared_head_between_one_offs()
    uses = fs.use_times(requests)
    table = fs.reuse_table(uses, 3)
    fitted = prefix_hit_ratio(requests, fs.FittedRanking(4, uses, table))
    inverted = {k: 1 - v for k, v in table.items()}  # the negative control
    lost = prefix_hit_ratio(requests, fs.FittedRanking(4, uses, inverted))
    assert fitted == pytest.approx(3 * 99 / (11 * 100))
    assert lost < 0.01  # the one-offs outrank the head: it is hardly ever found


def test_foresight_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write(shared_head_between_one_offs(), tmp_path / "t.jsonl")
    assert main(["foresight", str(trace), "--capacity", "4", "--windows", "1,3",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[1:3]]
    assert [(r[0], r[1]) for r in rows] == [("4", "1"), ("4", "3")]
    assert float(rows[0][3]) == 0.0 and float(rows[1][3]) > 0.25
    assert out[3].startswith("4 blocks: LRU 0.0000") and "past predicts" in out[3]
    assert main(["foresight", str(trace), "--capacity", "4", "--windows", "3", "--json",
                 "--no-progress"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["capacity"] == 4 and row["window"] == 3 and row["lru"] == 0.0
    assert row["past"] == pytest.approx(float(rows[1][3]), abs=1e-4)
    with pytest.raises(SystemExit):
        main(["foresight", str(trace), "--windows", "0"])


def test_foresight_behind_the_engine_ranks_what_kvtier_is_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = generate("chat", seed=2, requests=300)
    write_trace(requests, tmp_path / "chat.jsonl")
    whole = fs.asked_streams(requests, 0)
    asked = fs.asked_streams(requests, 64)
    # the engine's hits are not asked: fewer blocks, and a request's asked blocks
    # are numbered keys, not the trace's hash ids
    assert 0 < sum(map(len, asked)) < sum(map(len, whole))
    assert main(["foresight", str(tmp_path / "chat.jsonl"), "--gpu-blocks", "64",
                 "--capacity", "16", "--windows", "10", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["16", "10"]
    # the longest request does not fit the engine: a usage error naming it
    assert main(["foresight", str(tmp_path / "chat.jsonl"), "--gpu-blocks", "2",
                 "--no-progress"]) == 2
    assert "longest request" in capsys.readouterr().err


def test_foresight_command_names_a_missing_or_bad_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["foresight", str(tmp_path / "nowhere.jsonl"), "--no-progress"]) == 2
    assert "trace file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["foresight", str(bad), "--no-progress"]) == 2
    assert "malformed trace" in capsys.readouterr().err


def test_readings_say_which_ranking_gains() -> None:
    # (capacity, window) -> (LRU, past, future, fitted)
    results = {(100, 10): (0.10, 0.13, 0.30, 0.11),  # history gains (past 1.3 x)
               (100, 50): (0.10, 0.10, 0.20, 0.10),
               (200, 10): (0.20, 0.21, 0.40, 0.20),  # only foresight gains
               (400, 10): (0.40, 0.41, 0.42, 0.40),  # nothing gains
               (800, 10): (0.0, 0.0, 0.0, 0.0)}      # an empty cache finds nothing at all
    lines = fs.readings(results)
    assert [line.split(" ")[0] for line in lines] == ["100", "200", "400", "800"]
    assert "past predicts" in lines[0] and "(1.30 x)" in lines[0]
    assert "does not say when it comes back" in lines[1]
    assert "no ranking gains" in lines[2] and "no ranking gains" in lines[3]


def test_progress_counts_every_request_once() -> None:
    requests = chat_requests(n=250)
    told: list[int] = []
    ratio = prefix_hit_ratio(requests, LRUCache(40), told.append)
    assert told == [100, 100, 50]
    assert ratio == prefix_hit_ratio(requests, LRUCache(40))  # the callback changes nothing


def test_limit_requests_ranks_only_the_first_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = chat_requests(n=300)
    trace = _write(requests, tmp_path / "chat.jsonl")
    assert main(["foresight", str(trace), "--capacity", "32", "--windows", "20",
                 "--limit-requests", "120", "--json", "--no-progress"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["lru"] == prefix_hit_ratio(requests[:120], LRUCache(32))
    assert row["lru"] != prefix_hit_ratio(requests, LRUCache(32))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_caches_name_a_bad_capacity_or_window(bad: object) -> None:
    uses = fs.use_times(shared_head_between_one_offs())
    with pytest.raises(ValueError, match="capacity"):
        LRUCache(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity"):
        fs.FittedRanking(bad, uses, {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        fs.WindowLFU(4, bad, uses, future=False)  # type: ignore[arg-type]
