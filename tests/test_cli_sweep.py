"""``kvtier replay`` sweeps: bounds rows, JSON fields, plots, the engine driver, 'default'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main

LINES = [
    '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}',
    '{"timestamp": 5, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 3]}',
    '{"timestamp": 9, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 4]}',
    '{"timestamp": 9, "input_length": 1536, "output_length": 8, "hash_ids": [5, 6, 7]}',
    '{"timestamp": 9, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 3]}',
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bounds_rows_in_the_table(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "3,100",
                        "--policy", "lru,default", "--bounds")
    assert code == 0
    _, *rows = out.splitlines()
    assert len({len(line) for line in out.splitlines()}) == 1  # aligned
    cells = [row.split() for row in rows]
    assert [(c[0], c[1]) for c in cells] == [
        ("lru", "3"), ("lru", "100"), ("default", "3"), ("default", "100"),
        ("opt", "3"), ("opt", "100"), ("infinite", "7")]
    assert cells[-1][-1] == "-" and cells[-2][-1] == "-"
    ratio = {(c[0], c[1]): float(c[3]) for c in cells}
    assert ratio[("opt", "3")] >= max(ratio[("lru", "3")], ratio[("default", "3")])
    assert ratio[("infinite", "7")] == pytest.approx(7 / 14, abs=1e-4)


def test_bounds_as_policy_names_and_json(capsys: pytest.CaptureFixture[str],
                                        trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "4", "--policy",
                        "plfu,opt", "--store-threshold", "1,2", "--json", "--block-bytes", "8")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["policy"], r["store_threshold"]) for r in rows] == [
        ("plfu", 1), ("plfu", 2), ("opt", 1)]
    for r in rows:
        assert r["bytes_written"] == 8 * r["stores"]
        assert r["writes_per_hit"] == (r["stores"] / r["hit_blocks"] if r["hit_blocks"] else None)
        assert r["driver"] in ("sequential", "bound")


def test_plot_is_written(capsys: pytest.CaptureFixture[str], trace: Path,
                         tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    code, _, err = _run(capsys, "replay", str(trace), "--capacity", "2,3,10", "--policy",
                        "lru,arc", "--store-threshold", "1,2", "--bounds", "--plot", str(png))
    assert code == 0 and f"wrote plot {png}" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_to_a_bad_path_is_an_error(capsys: pytest.CaptureFixture[str],
                                        trace: Path, tmp_path: Path) -> None:
    code, _, err = _run(capsys, "replay", str(trace), "--capacity", "2", "--policy", "lru",
                        "--plot", str(tmp_path / "missing" / "x.png"))
    assert code == 2 and "cannot write plot" in err


def test_engine_driver_from_the_command_line(capsys: pytest.CaptureFixture[str],
                                             trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "6", "--policy", "lru",
                        "--driver", "engine", "--concurrency", "2", "--max-delay", "1",
                        "--preempt", "0.5", "--seed", "3", "--json")
    assert code == 0
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["driver"], row["concurrency"]) == ("engine", 2)
    assert row["offered_blocks"] == 14


@pytest.mark.parametrize(("option", "value"), [("--preempt", "1.5"), ("--max-delay", "-1")])
def test_bad_engine_options(capsys: pytest.CaptureFixture[str], trace: Path,
                            option: str, value: str) -> None:
    code, _, err = _run(capsys, "replay", str(trace), "--capacity", "4", "--policy", "lru",
                        "--driver", "engine", option, value)
    assert code == 2 and option in err


def test_unknown_policy_still_listed_with_bounds(capsys: pytest.CaptureFixture[str],
                                                trace: Path) -> None:
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "4", "--policy",
                          "opt,lfu")
    assert code == 2 and out == ""
    assert "unknown eviction policy 'lfu'" in err and "plfu" in err
