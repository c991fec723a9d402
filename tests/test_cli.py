"""The ``kvtier`` command line (kvtier.cli, python -m kvtier)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import main
from kvtier.progress import NoProgress, TqdmProgress, make_progress

ROOT = Path(__file__).resolve().parents[1]
LINES = [
    '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}',
    '{"timestamp": 5, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 3]}',
    '{"timestamp": 9, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 4]}',
]
RESULT_FIELDS = {
    "policy", "capacity", "store_threshold", "requests", "offered_blocks", "hit_blocks",
    "hit_ratio", "stores", "evictions", "stores_skipped", "allocation_failures",
    "bytes_written", "us_per_key",
}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """A three-request trace: 8 offered blocks, 4 prefix hits with room for all."""
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


# -- output ----------------------------------------------------------------------


def test_json_lines_per_combination(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "10,2",
                        "--policy", "lru,arc", "--store-threshold", "1,2", "--json",
                        "--block-bytes", "100")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["policy"], r["capacity"], r["store_threshold"]) for r in rows] == [
        (p, c, k) for p in ("lru", "arc") for c in (10, 2) for k in (1, 2)
    ]
    for row in rows:
        assert set(row) >= RESULT_FIELDS
        assert row["trace"] == str(trace)
        assert row["bytes_written"] == 100 * row["stores"]
        assert row["offered_blocks"] == 8 and row["requests"] == 3
    first = rows[0]
    assert (first["hit_blocks"], first["hit_ratio"], first["stores"]) == (4, 0.5, 4)


def test_table_is_aligned(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "10,2",
                          "--policy", "lru")
    assert code == 0 and err == ""
    header, *rows = out.splitlines()
    assert header.split() == ["policy", "capacity", "threshold", "hit", "ratio", "stores",
                              "evictions", "us/key"]
    assert len(rows) == 2
    assert len({len(line) for line in out.splitlines()}) == 1
    assert rows[0].split()[:4] == ["lru", "10", "1", "0.5000"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtier {kvtier.__version__}"


# -- bad input ---------------------------------------------------------------------


def test_unknown_policy_exits_2_listing_known(capsys: pytest.CaptureFixture[str],
                                              trace: Path) -> None:
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "10",
                          "--policy", "lru,lfu")
    assert code == 2 and out == ""
    assert err.startswith("kvtier: error: unknown eviction policy 'lfu'")
    assert "known policies: adaptive, arc, lru" in err


def test_malformed_line_reports_line_3(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([LINES[0], LINES[1], '{"hash_ids": [1, "x"]}', LINES[2]]) + "\n")
    code, out, err = _run(capsys, "replay", str(path), "--capacity", "10", "--policy", "lru")
    assert code == 2 and out == ""
    assert err.startswith("kvtier: error: malformed trace:")
    assert f"{path}:3:" in err


def test_missing_trace_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _run(capsys, "replay", str(tmp_path / "nope.jsonl"), "--capacity", "10",
                        "--policy", "lru")
    assert code == 2
    assert err.strip() == f"kvtier: error: trace file not found: {tmp_path / 'nope.jsonl'}"


def test_empty_trace_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    code, _, err = _run(capsys, "replay", str(path), "--capacity", "10", "--policy", "lru")
    assert code == 2 and "no requests" in err


@pytest.mark.parametrize("capacity", ["0", "abc", "10,,20", "-5", "1.5"])
def test_bad_capacity_is_a_usage_error(capsys: pytest.CaptureFixture[str], trace: Path,
                                       capacity: str) -> None:
    err = _usage_error(capsys, "replay", str(trace), "--capacity", capacity, "--policy", "lru")
    assert "argument --capacity" in err


def test_missing_required_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--capacity" in _usage_error(capsys, "replay", "--policy", "lru")
    assert "COMMAND" in _usage_error(capsys)


# -- progress ------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_tty() -> None:
    assert isinstance(make_progress(10, True, io.StringIO()), NoProgress)
    assert isinstance(make_progress(10, False, _Tty()), NoProgress)
    bar = make_progress(10, True, _Tty())
    assert isinstance(bar, TqdmProgress)
    bar.close()


def test_progress_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    assert isinstance(make_progress(10, True, _Tty()), NoProgress)


# -- python -m kvtier ------------------------------------------------------------------


def _python_m(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvtier", *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120, check=False)


def test_python_m_kvtier_replays_bundled_trace() -> None:
    proc = _python_m("replay", "--capacity", "1000", "--policy", "lru", "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert abs(row["hit_ratio"] - 0.0445) < 0.0005
    assert row["trace"].endswith("data/mooncake/conversation_trace.jsonl")
    assert proc.stderr == ""  # no bar when stderr is not a TTY


def test_python_m_kvtier_bad_policy(trace: Path) -> None:
    proc = _python_m("replay", str(trace), "--capacity", "4", "--policy", "mru")
    assert proc.returncode == 2
    assert "kvtier: error: unknown eviction policy 'mru'" in proc.stderr


# -- options that need something else --------------------------------------------------


def test_gpu_blocks_needs_input_lengths(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    # a trace without input_length: behind the engine it used to be served as
    # one-token prompts, every ratio 0.0000 with status 0
    path = tmp_path / "nolen.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": json.loads(line)["hash_ids"]}) + "\n"
                            for line in LINES), encoding="utf-8")
    message = (f"kvtier: error: --gpu-blocks needs each request's input_length (its prompt "
               f"tokens); {path} line 1 has hash_ids but no input_length (absent or 0)")
    for argv in (["replay", str(path), "--capacity", "10", "--policy", "lru"],
                 ["foresight", str(path), "--capacity", "4", "--windows", "2"]):
        code, out, err = _run(capsys, *argv, "--gpu-blocks", "50", "--no-progress")
        assert (code, out, err.strip()) == (2, "", message)
    # the replay that counts blocks only reads absent lengths as 0, as the README says
    code, out, _ = _run(capsys, "replay", str(path), "--capacity", "10", "--policy", "lru",
                        "--json")
    assert code == 0 and json.loads(out)["hit_blocks"] == 4


@pytest.mark.parametrize(("option", "value"), [
    ("--concurrency", "16"), ("--max-delay", "1"), ("--preempt", "0.5"), ("--seed", "3"),
])
def test_engine_options_need_the_engine_driver(capsys: pytest.CaptureFixture[str],
                                               trace: Path, option: str, value: str) -> None:
    # they used to be ignored: the sequential driver ran, its JSON said so
    code, out, err = _run(capsys, "replay", str(trace), "--capacity", "4", "--policy", "lru",
                          "--json", option, value)
    assert (code, out) == (2, "")
    assert err.strip() == f"kvtier: error: {option} is an engine driver option: it needs " \
                          "--driver engine"
    code, _, err = _run(capsys, "replay", str(trace), "--capacity", "4", "--policy", "lru",
                        "--json", "--driver", "sequential", option, value)
    assert code == 2 and f"{option} is an engine driver option" in err


@pytest.mark.parametrize("option", ["--max-delay", "--seed"])
def test_gpu_blocks_rejects_engine_options_it_ignores(capsys: pytest.CaptureFixture[str],
                                                      trace: Path, option: str) -> None:
    code, _, err = _run(capsys, "replay", str(trace), "--capacity", "4", "--policy", "lru",
                        "--gpu-blocks", "12", "--driver", "engine", option, "1")
    assert code == 2 and f"--gpu-blocks does not take {option}" in err


def test_engine_driver_defaults(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "6", "--policy", "lru",
                        "--driver", "engine", "--json")
    row = json.loads(out)
    assert code == 0 and (row["driver"], row["concurrency"]) == ("engine", 4)
    code, out, _ = _run(capsys, "replay", str(trace), "--capacity", "6", "--policy", "lru",
                        "--gpu-blocks", "12", "--driver", "engine", "--json")
    assert code == 0 and json.loads(out)["concurrency"] == 4


# -- SIGTERM -----------------------------------------------------------------------------


def sigterm_leaves_no_temp_dir(argv: list[str], prefix: str, tmp_path: Path) -> None:
    """Run ``python -m kvtier ARGV`` with its temporary files in ``tmp_path``,
    send SIGTERM once its ``PREFIX*`` directory exists, and check that the
    command exits with 128 + SIGTERM having removed it (as SIGINT does)."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", *argv], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(prefix + "*")):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no temporary directory after 60 s"
            time.sleep(0.05)
        time.sleep(0.3)  # into the run
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(tmp_path.iterdir()) == []


def test_sigterm_removes_the_disk_tier_of_a_tiered_replay(tmp_path: Path) -> None:
    sigterm_leaves_no_temp_dir(["replay", "--capacity", "100", "--disk-blocks", "1000",
                                "--policy", "lru", "--no-progress"], "kvtier-tiered-",
                               tmp_path)
