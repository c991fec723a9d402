"""`kvtier bench serve` and `bench faults` keep earlier results: every input is
checked before a result file is touched, earlier runs are moved aside (never
emptied), `--resume` takes only runs of the same settings, a mistake is one
line of error, and summaries are written whole. No server starts here: the
runs themselves are replaced by fakes."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import faults, serving
from kvtier.bench.outfiles import atomic_output, move_aside, write_atomic
from kvtier.cli import main
from kvtier.demo.tiny_model import is_built
from kvtier.replay.generate import write_trace
from kvtier.replay.trace import TraceRequest
from kvtier.server_process import ServerError

OLD_RUNS = "earlier runs\n"
REAL_PLOT = serving.plot


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model dir the benchmark takes as built (no model is ever loaded here)."""
    path = tmp_path / "model"
    path.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "generation_config.json"):
        (path / name).write_text("{}")
    assert is_built(path)
    return path


def _trace(path: Path, blocks: int = 4, requests: int = 3) -> Path:
    """A Mooncake trace of ``requests`` prompts of ``blocks`` 512-token blocks
    (``blocks`` engine blocks once scaled, plus 8 output tokens)."""
    write_trace([TraceRequest(10 * i, 512 * blocks, 8, tuple(range(i, i + blocks)))
                 for i in range(requests)], path)
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return _trace(tmp_path / "trace.jsonl")


def _fake_run(config: str, scenario: serving.Scenario, repeat: int) -> serving.RunResult:
    return serving.RunResult(
        config=config, traffic=scenario.traffic, regime=scenario.regime,
        cpu_blocks=scenario.cpu_blocks, repeat=repeat, completed=3, failed=0,
        throughput=1.0, ttft_mean_ms=10.0, ttft_p50_ms=10.0, ttft_p99_ms=10.0,
        ttft_max_ms=10.0, hit_ratio=0.5, external_queries=2.0, external_hits=1.0)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Runs return fake figures at once (no server); the list records them.
    The plot is a stub (matplotlib is slow to start)."""
    made: list[tuple[str, str, int]] = []

    def run_one(s: serving.BenchSettings, config: str, scenario: serving.Scenario,
                repeat: int, trace: Path, work: Path) -> serving.RunResult:
        assert trace.is_file() and trace.parent == work
        made.append((config, scenario.label, repeat))
        return _fake_run(config, scenario, repeat)

    monkeypatch.setattr(serving, "run_one", run_one)
    monkeypatch.setattr(serving, "plot", lambda rows, out: out.write_bytes(b"png"))
    return made


def _serve(out: Path, model: Path, trace: Path, *extra: str) -> list[str]:
    return ["bench", "serve", "--out", str(out), "--model-dir", str(model),
            "--trace", str(trace), "--traffic", "bundled", "--regimes", "paced",
            "--cpu-blocks", "1000", "--repeats", "1", "--configs", "none,lru",
            "--requests", "3", *extra]


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    """The command's error: its last line of output, one line, no traceback."""
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("kvtier: error: ") and "Traceback" not in err, err
    return err.splitlines()[-1]


def _earlier(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").write_text(OLD_RUNS)
    (out / "trace-bundled.jsonl").write_text("earlier trace\n")
    return out


@pytest.mark.parametrize("mistake,message", [
    (["--gpu-blocks", "2"], r"a request of 136 tokens does not fit .* 2 blocks"),
    (["--trace", "MISSING"], "trace file not found"),
    (["--trace", "MALFORMED"], r"malformed trace: .*bad\.jsonl:2: not valid JSON"),
    (["--trace", "EMPTY"], r"empty\.jsonl: the trace has no requests"),
])
def test_a_mistaken_run_keeps_the_earlier_runs_and_says_why(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any], mistake: list[str],
        message: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _earlier(tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text(trace.read_text().splitlines()[0] + "\n{oops\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    files = {"MISSING": tmp_path / "nope.jsonl", "MALFORMED": tmp_path / "bad.jsonl",
             "EMPTY": tmp_path / "empty.jsonl"}
    mistake = [str(files.get(m, m)) for m in mistake]
    assert main(_serve(out, model, trace, *mistake)) == 2
    assert re.search(message, _error(capsys))
    assert (out / "runs.jsonl").read_text() == OLD_RUNS
    assert (out / "trace-bundled.jsonl").read_text() == "earlier trace\n"
    assert sorted(p.name for p in out.iterdir()) == ["runs.jsonl", "trace-bundled.jsonl"]
    assert runs == []


def test_a_new_run_moves_the_earlier_runs_aside(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    out = _earlier(tmp_path / "out")
    (out / "runs.jsonl.1").write_text("older still\n")
    assert main(_serve(out, model, trace)) == 0
    assert "runs.jsonl.2" in capsys.readouterr().err
    assert (out / "runs.jsonl.2").read_text() == OLD_RUNS
    assert (out / "runs.jsonl.1").read_text() == "older still\n"
    assert len(serving.load_runs(out / "runs.jsonl")) == 2 and len(runs) == 2
    first = json.loads((out / "settings.json").read_text())
    assert first["requests"] == 3 and first["trace"] == str(trace.resolve())
    first_runs = (out / "runs.jsonl").read_text()
    assert main(_serve(out, model, trace, "--requests", "2")) == 0
    assert (out / "runs.jsonl.3").read_text() == first_runs
    assert json.loads((out / "settings.json.3").read_text()) == first
    assert json.loads((out / "settings.json").read_text())["requests"] == 2
    assert (out / "summary.txt").read_text().count("\n") > 2


def test_resume_takes_the_runs_of_the_same_settings(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any]) -> None:
    out = tmp_path / "out"
    assert main(_serve(out, model, trace)) == 0
    assert main(_serve(out, model, trace, "--resume", "--configs", "none,lru,default")) == 0
    assert [config for config, _, _ in runs] == ["none", "lru", "default"]
    assert len(serving.load_runs(out / "runs.jsonl")) == 3
    assert not list(out.glob("runs.jsonl.*"))


@pytest.mark.parametrize("change,named", [
    (["--requests", "2"], "--requests 3, this command has 2"),
    (["--speedup", "5"], "--speedup 25.0, this command has 5.0"),
    (["--gpu-blocks", "400"], "--gpu-blocks 500, this command has 400"),
    (["--concurrency", "4"], "--concurrency 16, this command has 4"),
    (["--trace", "OTHER"], "--trace"),
    (["--trace", "CHANGED"], "another bundled trace"),
])
def test_resume_refuses_runs_of_other_settings(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any], change: list[str],
        named: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(_serve(out, model, trace)) == 0
    before = (out / "runs.jsonl").read_text()
    capsys.readouterr()
    if change == ["--trace", "CHANGED"]:
        _trace(trace, blocks=3)  # the same file, other requests
        change = []
    elif change == ["--trace", "OTHER"]:
        change = ["--trace", str(_trace(tmp_path / "other.jsonl"))]
    assert main(_serve(out, model, trace, "--resume", *change)) == 2
    err = _error(capsys)
    assert named in err and "--resume" in err
    assert (out / "runs.jsonl").read_text() == before and len(runs) == 2


def test_resume_redoes_a_run_whose_line_was_cut_short(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    """A kill or a full disk mid-append leaves runs.jsonl's last line torn (no
    newline, not JSON); `load_runs` refused the file ("not a run"), so
    `--resume` did nothing until the user edited it. The torn line is left
    out with a warning, and its run made again on a line of its own."""
    out = tmp_path / "out"
    assert main(_serve(out, model, trace)) == 0
    whole, last = (out / "runs.jsonl").read_text().splitlines(keepends=True)
    (out / "runs.jsonl").write_text(whole + last[:40])
    capsys.readouterr()
    assert main(_serve(out, model, trace, "--summarize")) == 0  # the whole runs
    assert "runs.jsonl:2 is a run cut short" in capsys.readouterr().err
    assert main(_serve(out, model, trace, "--resume")) == 0
    assert "runs.jsonl:2 is a run cut short" in capsys.readouterr().err
    assert [config for config, _, _ in runs] == ["none", "lru", "lru"]
    text = (out / "runs.jsonl").read_text()
    assert text.startswith(whole) and text.endswith("\n")
    assert [r.config for r in serving.load_runs(out / "runs.jsonl")] == ["none", "lru"]
    assert not list(out.glob("runs.jsonl.*"))


def test_resume_still_refuses_a_malformed_line_before_the_last(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(_serve(out, model, trace)) == 0
    first, last = (out / "runs.jsonl").read_text().splitlines(keepends=True)
    for text in (first[:40] + "\n" + last, first + last.rstrip("\n") + "}\n"):
        (out / "runs.jsonl").write_text(text)
        capsys.readouterr()
        assert main(_serve(out, model, trace, "--resume")) == 2
        err = _error(capsys)
        assert re.search(r"runs\.jsonl:[12]: not a run", err), err
        assert (out / "runs.jsonl").read_text() == text and len(runs) == 2


def test_resume_refuses_runs_whose_settings_are_unknown(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = _fake_run("none", serving.Scenario("bundled", "paced", 1000), 0)
    (out / "runs.jsonl").write_text(json.dumps(asdict(run)) + "\n")  # an older kvtier's
    assert main(_serve(out, model, trace, "--resume")) == 2
    assert "no settings.json" in _error(capsys)
    assert runs == [] and len(serving.load_runs(out / "runs.jsonl")) == 1


def test_a_server_that_does_not_start_is_one_line_of_error(
        tmp_path: Path, model: Path, trace: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*args: Any) -> serving.RunResult:
        raise ServerError("server exited with status 1 before it was ready:\nlog tail\n")

    monkeypatch.setattr(serving, "run_one", fail)
    out = tmp_path / "out"
    assert main(_serve(out, model, trace)) == 2
    err = _error(capsys)
    assert "server exited with status 1" in err and "--resume continues" in err


def test_summarize_without_runs_writes_nothing(
        tmp_path: Path, model: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    summarize = ["bench", "serve", "--out", str(out), "--summarize"]
    assert main(summarize) == 2
    assert "no directory" in _error(capsys) and not out.exists()
    out.mkdir()
    (out / "summary.txt").write_text("the earlier summary\n")
    assert main(summarize) == 2
    assert "no runs to summarize" in _error(capsys)
    (out / "runs.jsonl").write_text("{not a run\n")
    assert main(summarize) == 2
    assert "runs.jsonl:1: not a run" in _error(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["runs.jsonl", "summary.txt"]
    assert (out / "summary.txt").read_text() == "the earlier summary\n"


def test_summarize_writes_the_summary_and_plot(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main(_serve(out, model, trace)) == 0
    monkeypatch.undo()  # the real plot
    for name in ("summary.txt", "summary.json", "plot.png"):
        (out / name).unlink()
    assert main(["bench", "serve", "--out", str(out), "--summarize",
                 "--configs", "none,lru", "--cpu-blocks", "1000"]) == 0
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads((out / "summary.json").read_text())) == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_a_file_is_written_whole_or_not_at_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.txt"
    write_atomic(path, "first\n")
    with pytest.raises(RuntimeError), atomic_output(path) as f:
        f.write(b"half")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "first\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.txt"]


def test_only_a_file_with_results_is_moved_aside(tmp_path: Path) -> None:
    main_file, companion = tmp_path / "runs.jsonl", tmp_path / "settings.json"
    assert move_aside(main_file, companion) is None
    main_file.write_text("")
    assert move_aside(main_file, companion) is None and main_file.exists()
    main_file.write_text("x\n")
    companion.write_text("{}")
    (tmp_path / "settings.json.1").write_text("taken")
    assert move_aside(main_file, companion) == tmp_path / "runs.jsonl.2"
    assert (tmp_path / "settings.json.2").read_text() == "{}"
    assert not main_file.exists() and not companion.exists()


@pytest.fixture
def fault_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made: list[str] = []

    def run_fault(s: faults.FaultSettings, fault: str, trace: Path,
                  work: Path) -> faults.FaultResult:
        assert trace.is_file()
        made.append(fault)
        return faults.FaultResult(fault=fault, completed=s.requests, ttft_p99_ms=5.0)

    monkeypatch.setattr(faults, "run_fault", run_fault)
    return made


def test_bench_faults_moves_the_earlier_results_aside(
        tmp_path: Path, model: Path, fault_runs: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "faults.jsonl").write_text("earlier faults\n")
    argv = ["bench", "faults", "--out", str(out), "--model-dir", str(model),
            "--faults", "none,disk-slow", "--requests", "5"]
    assert main(argv) == 0
    assert "faults.jsonl.1" in capsys.readouterr().err
    assert (out / "faults.jsonl.1").read_text() == "earlier faults\n"
    assert fault_runs == ["none", "disk-slow"]
    assert [json.loads(line)["fault"] for line in
            (out / "faults.jsonl").read_text().splitlines()] == fault_runs
    assert "disk-slow" in (out / "faults.txt").read_text()
    assert len((out / "trace.jsonl").read_text().splitlines()) == 5


def test_bench_faults_moves_the_earlier_table_aside_with_its_results(
        tmp_path: Path, model: Path, fault_runs: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """faults.jsonl was moved aside, faults.txt left in place: while the new
    runs went (and for good when one failed) OUT held the table of runs now
    in faults.jsonl.1, and a finished run overwrote it, the earlier table lost."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "faults.jsonl").write_text("earlier faults\n")
    (out / "faults.txt").write_text("earlier table\n")
    seen: list[bool] = []

    def run_fault(s: faults.FaultSettings, fault: str, trace: Path,
                  work: Path) -> faults.FaultResult:
        seen.append((out / "faults.txt").exists())
        return faults.FaultResult(fault=fault, completed=s.requests, ttft_p99_ms=5.0)

    monkeypatch.setattr(faults, "run_fault", run_fault)
    argv = ["bench", "faults", "--out", str(out), "--model-dir", str(model),
            "--faults", "none", "--requests", "5"]
    assert main(argv) == 0
    assert seen == [False]  # no table of other runs while the runs go
    assert (out / "faults.txt.1").read_text() == "earlier table\n"
    assert (out / "faults.jsonl.1").read_text() == "earlier faults\n"
    assert "none" in (out / "faults.txt").read_text()


def test_bench_faults_says_in_one_line_that_a_server_did_not_start(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*args: Any) -> faults.FaultResult:
        raise ServerError("server not ready after 300 s:\nlog tail\n")

    monkeypatch.setattr(faults, "run_fault", fail)
    argv = ["bench", "faults", "--out", str(tmp_path / "out"), "--model-dir", str(model),
            "--faults", "none", "--requests", "5"]
    assert main(argv) == 2
    assert "server not ready after 300 s (server logs in" in _error(capsys)


def test_a_plot_that_fails_leaves_the_earlier_one(
        tmp_path: Path, model: Path, trace: Path, runs: list[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    out = tmp_path / "out"
    assert main(_serve(out, model, trace)) == 0
    monkeypatch.setattr(serving, "plot", REAL_PLOT)

    def savefig(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(fname, (str, Path)):
            Path(fname).write_bytes(b"half a plot")
        else:
            fname.write(b"half a plot")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(OSError):
        main(["bench", "serve", "--out", str(out), "--summarize", "--configs", "none,lru",
              "--cpu-blocks", "1000"])
    assert (out / "plot.png").read_bytes() == b"png"  # the stub's, from the run
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]

