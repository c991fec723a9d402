"""Replays under several key seeds and their medians (kvtier.replay.seeds,
``kvtier replay --key-seed 0-7``)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvtier.argtypes import MAX_SEEDS, seed_list
from kvtier.cli import main
from kvtier.policies import POLICIES
from kvtier.replay.driver import ReplayResult
from kvtier.replay.generate import generate, write_trace
from kvtier.replay.seeds import seeds_label, summarize


@pytest.mark.parametrize(("text", "seeds"), [
    ("0", [0]), ("0-3", [0, 1, 2, 3]), ("5, 0-2,1", [5, 0, 1, 2]), ("7-7", [7]),
    (f"0-{MAX_SEEDS - 1}", list(range(MAX_SEEDS))),
    (f"{2**64 - 1}", [2**64 - 1]),
])
def test_seed_lists(text: str, seeds: list[int]) -> None:
    assert seed_list(text) == seeds


@pytest.mark.parametrize(("text", "error"), [
    ("-1", "seeds are >= 0, got '-1'"), ("3-1", "range '3-1' runs backwards"),
    ("a", "not a seed or a range A-B: 'a'"), ("1-b", "not a seed or a range A-B: '1-b'"),
    ("", "not a seed"), ("0,,1", "not a seed"), (f"{2**64}", "a seed is in [0, 2**64)"),
    (f"0-{MAX_SEEDS}", f"at most {MAX_SEEDS} seeds"),
    (f"0-{MAX_SEEDS - 1},{10**6}", f"at most {MAX_SEEDS} seeds"),
    ("0-1000000000000", f"at most {MAX_SEEDS} seeds"),
])
def test_bad_seed_lists_name_the_problem(text: str, error: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        seed_list(text)
    assert error in str(exc.value)


def test_seeds_label_writes_runs_as_ranges() -> None:
    assert seeds_label([0]) == "0"
    assert seeds_label([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"


def _result(policy: str, capacity: int, hit_ratio: float) -> ReplayResult:
    return ReplayResult(policy, capacity, 1, 10, 100, int(hit_ratio * 100), hit_ratio,
                        0, 0, 0, 0, 0, 0.0)


def test_summaries_are_medians_of_per_seed_ratios() -> None:
    results = [(seed, _result(p, 10, h)) for seed, p, h in [
        (0, "lru", 0.10), (0, "x", 0.30),
        (1, "lru", 0.20), (1, "x", 0.20),
        (2, "lru", 0.05), (2, "x", 0.25),
    ]]
    lru, x = summarize(results, "lru")
    assert (lru.vs_baseline, lru.vs_min, lru.vs_max) == (1.0, 1.0, 1.0)
    assert x.key_seeds == (0, 1, 2)
    assert (x.hit_ratio, x.hit_ratio_min, x.hit_ratio_max) == (0.25, 0.20, 0.30)
    # the median of the ratios (3, 1, 5), not the ratio of the medians (0.25 / 0.10)
    assert (x.vs_baseline, x.vs_min, x.vs_max) == (pytest.approx(3.0), 1.0, 5.0)
    assert x.to_dict()["key_seeds"] == [0, 1, 2]


def test_a_seed_where_the_baseline_hit_nothing_has_no_ratio() -> None:
    results = [(0, _result("lru", 10, 0.0)), (0, _result("x", 10, 0.1)),
               (1, _result("lru", 10, 0.1)), (1, _result("x", 10, 0.2))]
    x = summarize(results, "lru")[1]
    assert (x.vs_baseline, x.vs_min, x.vs_max) == (2.0, 2.0, 2.0)
    none = summarize(results[:2], "lru")[1]
    assert (none.vs_baseline, none.vs_min, none.vs_max) == (None, None, None)


def test_a_missing_baseline_is_named() -> None:
    with pytest.raises(ValueError, match="no lru replay at capacity 20"):
        summarize([(0, _result("lru", 10, 0.1)), (0, _result("x", 20, 0.1))], "lru")
    with pytest.raises(ValueError, match="under every key seed"):
        summarize([(0, _result("lru", 10, 0.1)), (0, _result("x", 10, 0.1)),
                   (1, _result("x", 10, 0.1))], "lru")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seeds") / "t.jsonl"
    write_trace(generate("tenants", 2, 800), path)
    return path


def _json_rows(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert main(["replay", *argv, "--json", "--no-progress"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("gpu", [[], ["--gpu-blocks", "200"]])
def test_replay_under_several_seeds_reports_each_and_their_medians(
        capsys: pytest.CaptureFixture[str], trace: Path, gpu: list[str]) -> None:
    rows = _json_rows(capsys, str(trace), "--capacity", "100,300", "--policy",
                      "lru,default", "--key-seed", "0-2,9", "--bounds", *gpu)
    replays = [r for r in rows if "summary" not in r and r["policy"] not in ("opt", "infinite")]
    # LRU reads no key bytes: replayed once, its row (no seed) stands for every seed
    assert [(r["key_seed"], r["policy"], r["capacity"]) for r in replays] == [
        (None, "lru", 100), (None, "lru", 300),
        *((s, "default", c) for s in (0, 1, 2, 9) for c in (100, 300))]
    bounds = [r for r in rows if "summary" not in r and r["policy"] in ("opt", "infinite")]
    assert [(r["policy"], r["capacity"], r["key_seed"]) for r in bounds] == [
        ("opt", 100, None), ("opt", 300, None), ("infinite", bounds[-1]["capacity"], None)]
    summaries = [r for r in rows if r.get("summary") == "key_seeds"]
    assert rows[-len(summaries):] == summaries  # the medians come last
    assert [(r["policy"], r["capacity"]) for r in summaries] == [
        ("lru", 100), ("lru", 300), ("default", 100), ("default", 300)]

    def hits(policy: str, capacity: int) -> list[float]:
        mine = [r["hit_ratio"] for r in replays
                if (r["policy"], r["capacity"]) == (policy, capacity)]
        return mine * 4 if len(mine) == 1 else mine  # a row for every seed

    for s in summaries:
        mine, base = hits(s["policy"], s["capacity"]), hits("lru", s["capacity"])
        assert s["key_seeds"] == [0, 1, 2, 9] and s["baseline"] == "lru"
        assert s["hit_ratio"] == statistics.median(mine)
        assert (s["hit_ratio_min"], s["hit_ratio_max"]) == (min(mine), max(mine))
        vs = [m / b for m, b in zip(mine, base, strict=True)]
        assert s["vs_baseline"] == pytest.approx(statistics.median(vs))
        assert (s["vs_min"], s["vs_max"]) == (pytest.approx(min(vs)), pytest.approx(max(vs)))
    assert len(set(hits("default", 100) + hits("default", 300))) > 2  # it samples by them
    # each seed's rows are what a replay under that seed alone gives
    alone = _json_rows(capsys, str(trace), "--capacity", "100,300", "--policy",
                       "lru,default", "--key-seed", "9", *gpu)

    def strip(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k not in ("us_per_key", "key_seed")}

    assert [strip(r) for r in alone] == [strip(r) for r in replays
                                         if r["key_seed"] in (None, 9)]


@pytest.mark.parametrize("gpu", [[], ["--gpu-blocks", "200"]])
def test_policies_that_read_no_key_bytes_give_the_same_figures_under_every_seed(
        capsys: pytest.CaptureFixture[str], trace: Path, gpu: list[str]) -> None:
    # what lets several key seeds replay them once: checked under single seeds,
    # where every policy runs; the default, which samples by hash, is the control
    names = [n for n, cls in POLICIES.items() if not cls.reads_key_bytes]
    assert names == ["lru", "arc"]

    def figures(seed: int) -> dict[tuple[str, int], tuple[float, int, int]]:
        rows = _json_rows(capsys, str(trace), "--capacity", "100,300", "--policy",
                          ",".join([*names, "default"]), "--key-seed", str(seed), *gpu)
        return {(r["policy"], r["capacity"]): (r["hit_ratio"], r["stores"], r["evictions"])
                for r in rows}

    first, other = figures(0), figures(5)
    assert {c: v for c, v in first.items() if c[0] != "default"} == {
        c: v for c, v in other.items() if c[0] != "default"}
    assert any(first[c] != other[c] for c in first if c[0] == "default")


def test_the_table_has_a_seed_column_and_a_median_section(
        capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    assert main(["replay", str(trace), "--capacity", "100", "--policy", "lru,default",
                 "--key-seed", "0,1,2", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["key", "seed", "policy"]
    assert [line.split()[:2] for line in lines[1:5]] == [
        ["-", "lru"], *([str(s), "default"] for s in (0, 1, 2))]  # LRU: once, every seed
    assert lines[5].startswith("median over key seeds 0-2; x lru:")
    assert lines[6].split() == ["policy", "capacity", "threshold", "median", "min", "max",
                                "x", "lru", "min", "max"]
    lru, default = (line.split() for line in lines[7:])
    assert lru[:2] == ["lru", "100"] and lru[6:] == ["1.000"] * 3
    assert default[:2] == ["default", "100"] and len(default) == 9
    # one seed: the table as it always was, no seed column, no medians
    assert main(["replay", str(trace), "--capacity", "100", "--policy", "lru",
                 "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "policy" and len(lines) == 2


def test_several_seeds_plot_medians_with_their_range(
        capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    shaded: list[tuple[list[float], list[float]]] = []
    real = Axes.fill_between

    def spy(self: Axes, x: Any, y1: Any, y2: Any, **kw: Any) -> Any:
        shaded.append((list(y1), list(y2)))
        return real(self, x, y1, y2, **kw)

    monkeypatch.setattr(Axes, "fill_between", spy)
    out = tmp_path / "p.png"
    rows = _json_rows(capsys, str(trace), "--capacity", "100,300", "--policy",
                      "lru,default", "--key-seed", "0-3", "--plot", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    default = [r for r in rows if r.get("summary") and r["policy"] == "default"]
    # the default's range is shaded; LRU's, the same under every seed, is not
    assert shaded == [([r["hit_ratio_min"] for r in default],
                       [r["hit_ratio_max"] for r in default])]


def test_disk_replays_take_one_seed(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    assert main(["replay", str(trace), "--capacity", "100", "--policy", "lru",
                 "--disk-blocks", "200", "--key-seed", "0,1", "--no-progress"]) == 2
    assert "--disk-blocks replays under one --key-seed at a time" in capsys.readouterr().err
