"""A user's own trace through ``kvtier replay`` and ``kvtier foresight``:
malformed lines end in one ``kvtier: error:`` line naming the file, the line
and the problem (exit status 2, no traceback), and the figures printed keep
their documented definitions on traces small enough to work out by hand."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}'


def _write(tmp_path: Path, text: str | bytes, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    if isinstance(text, str):
        text = text.encode("utf-8")
    path.write_bytes(text)
    return path


def _replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["replay", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def _foresight(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["foresight", "--no-progress", "--capacity", "2", "--windows", "1", *argv])
    out, err = capsys.readouterr()
    return status, out, err


# -- malformed lines: exit 2, one line naming the file, the line and the problem -----


LINE_TOO_BIG_TIMESTAMP = GOOD.replace('"timestamp": 0', '"timestamp": 1' + "0" * 400)
LINE_TOO_MANY_DIGITS = GOOD.replace('"input_length": 1024', '"input_length": 1' + "0" * 5000)
LINE_HUGE_HASH_ID = GOOD.replace("[1, 2]", "[1" + "0" * 5000 + "]")
LINE_DEEP = "[" * 100_000 + "]" * 100_000

MALFORMED = {
    # an int beyond the float range: math.isfinite raised OverflowError (traceback)
    "timestamp beyond float": (LINE_TOO_BIG_TIMESTAMP, "'timestamp' must be a non-negative"),
    # json refuses ints of more than 4300 digits with a plain ValueError, which
    # replay blamed on --key-seed and foresight let out as a traceback
    "length of 5001 digits": (LINE_TOO_MANY_DIGITS, "number too long to read"),
    "hash id of 5001 digits": (LINE_HUGE_HASH_ID, "number too long to read"),
    # json recurses once per nesting level: RecursionError (traceback)
    "nested too deeply": (LINE_DEEP, "nested too deeply"),
}


@pytest.mark.parametrize("command", ["replay", "foresight"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_unreadable_numbers_and_nesting_are_usage_errors_naming_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str) -> None:
    line, problem = MALFORMED[case]
    path = _write(tmp_path, f"{GOOD}\n\n{line}\n")
    run = _replay if command == "replay" else _foresight
    args = (("--capacity", "2", "--policy", "lru", str(path)) if command == "replay"
            else (str(path),))
    status, out, err = run(capsys, *args)
    assert status == 2
    assert out == ""
    assert err.startswith(f"kvtier: error: malformed trace: {path}:3: ")
    assert problem in err
    assert "--key-seed" not in err
    assert len(err) < 300 and err.count("\n") == 1  # the bad value is not quoted whole


def test_utf8_bom_before_the_first_line_is_read_as_the_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Windows PowerShell 5 (Out-File -Encoding utf8) and some editors write one;
    # it was refused with Python's own hint ("decode using utf-8-sig")
    plain = _write(tmp_path, f"{GOOD}\n{GOOD}\n", "plain.jsonl")
    bom = _write(tmp_path, b"\xef\xbb\xbf" + plain.read_bytes(), "bom.jsonl")
    rows = []
    for path in (plain, bom):
        status, out, err = _replay(capsys, "--capacity", "4", "--policy", "lru", "--json",
                                   str(path))
        assert status == 0, err
        row = json.loads(out)
        rows.append({k: v for k, v in row.items() if k not in ("trace", "us_per_key")})
    assert rows[0] == rows[1]
    assert rows[1]["hit_ratio"] == 0.5  # the second request hits both blocks of four


def test_bom_line_counts_in_the_line_numbers_of_later_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, b"\xef\xbb\xbf" + f"{GOOD}\n{{bad\n".encode())
    status, _, err = _replay(capsys, "--capacity", "2", "--policy", "lru", str(path))
    assert status == 2
    assert f"{path}:2: not valid JSON" in err


def test_gzip_trace_is_refused_saying_it_is_compressed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the README documents plain JSON lines only; the error said "not UTF-8 text"
    path = _write(tmp_path, gzip.compress(f"{GOOD}\n".encode()), "t.jsonl.gz")
    status, _, err = _replay(capsys, "--capacity", "2", "--policy", "lru", str(path))
    assert status == 2
    assert f"{path}: gzip-compressed" in err and "gunzip" in err


@pytest.mark.parametrize("command", ["replay", "foresight"])
def test_gpu_blocks_request_without_hash_ids_names_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    # it said "request 1 has no prompt tokens": no file, and an index that is
    # not the line (the blank line before it)
    empty = '{"timestamp": 1, "input_length": 1024, "output_length": 10, "hash_ids": []}'
    path = _write(tmp_path, f"{GOOD}\n\n{empty}\n")
    run = _replay if command == "replay" else _foresight
    args = ("--capacity", "2", "--policy", "lru") if command == "replay" else ()
    status, _, err = run(capsys, *args, "--gpu-blocks", "20", str(path))
    assert status == 2
    assert f"{path} line 3 has no prompt tokens (no hash_ids)" in err
    assert err.startswith("kvtier: error: --gpu-blocks needs each request's hash_ids")


def test_foresight_engine_too_small_names_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, f"{GOOD}\n")
    status, _, err = _foresight(capsys, "--gpu-blocks", "2", str(path))
    assert status == 2
    assert err.startswith("kvtier: error: --gpu-blocks 2: ")  # as replay says it


# -- option combinations that were silently ignored ------------------------------


@pytest.mark.parametrize("bound", ["opt", "infinite"])
def test_disk_blocks_refuses_bound_policies_instead_of_dropping_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bound: str) -> None:
    # "--policy lru,opt --disk-blocks N" printed the lru row only
    path = _write(tmp_path, f"{GOOD}\n")
    status, out, err = _replay(capsys, "--capacity", "2", "--policy", f"lru,{bound}",
                               "--disk-blocks", "4", str(path))
    assert status == 2
    assert out == ""
    assert "opt or infinite" in err


# -- figures against their definitions, by hand --------------------------------------


def _hand_trace(tmp_path: Path) -> Path:
    lines = [{"timestamp": i, "input_length": 512 * len(ids), "output_length": 10,
              "hash_ids": ids} for i, ids in enumerate([[1, 2], [3], [1, 2], [3, 1]])]
    return _write(tmp_path, "".join(json.dumps(x) + "\n" for x in lines))


def test_hit_ratio_and_bounds_match_a_hand_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Capacity 2, requests [1,2] [3] [1,2] [3,1]: 7 offered blocks.

    LRU (a request's stored blocks leave tail first, as the Mooncake README's
    LRU does): [1,2] stores 1, 2; [3] stores 3 and evicts 2 (the tail);
    [1,2] hits 1, stores 2 and evicts 3; [3,1] misses 3 (no prefix hit), stores
    3 and evicts 2. Prefix hits 1 -> 1/7; stores 5, evictions 3.
    OPT (Belady with bypass on the flat sequence 1 2 3 1 2 3 1): keeps 1 and 2,
    bypasses 3 twice: hits 1 2 1 -> 3/7, stores 2. Infinite: 7 - 3 distinct = 4/7.
    """
    status, out, err = _replay(capsys, "--capacity", "2", "--policy", "lru", "--bounds",
                               "--json", str(_hand_trace(tmp_path)))
    assert status == 0, err
    rows = {r["policy"]: r for r in map(json.loads, out.splitlines())}
    assert set(rows) == {"lru", "opt", "infinite"}
    lru, opt, inf = rows["lru"], rows["opt"], rows["infinite"]
    assert (lru["offered_blocks"], lru["hit_blocks"], lru["stores"], lru["evictions"]) == (
        7, 1, 5, 3)
    assert lru["hit_ratio"] == pytest.approx(1 / 7)
    assert lru["writes_per_hit"] == 5.0
    assert (opt["hit_blocks"], opt["stores"], opt["hit_ratio"]) == (3, 2, pytest.approx(3 / 7))
    assert (inf["capacity"], inf["hit_blocks"], inf["hit_ratio"]) == (3, 4, pytest.approx(4 / 7))


def test_gpu_blocks_ratios_match_a_hand_count(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two equal requests of 1024 tokens (two 512-token blocks: two 32-token engine
    blocks, 64 prompt tokens) behind a 10-block engine cache.

    First: no engine hit, kvtier asked for 64 tokens, no hit, both blocks stored.
    Second: the engine serves block 0 (vLLM recomputes at least the last token,
    so not block 1), kvtier is asked for the other 32 tokens and has block 1.
    CPU tier 32 / (64 + 32); engine 32 / 128 prompt tokens; combined 64 / 128.
    """
    path = _write(tmp_path, f"{GOOD}\n{GOOD}\n")
    status, out, err = _replay(capsys, "--capacity", "4", "--policy", "lru",
                               "--gpu-blocks", "10", "--json", str(path))
    assert status == 0, err
    row = json.loads(out)
    assert (row["queried_tokens"], row["hit_tokens"], row["prompt_tokens"],
            row["gpu_hit_tokens"]) == (96, 32, 128, 32)
    assert row["hit_ratio"] == pytest.approx(1 / 3)
    assert row["gpu_hit_ratio"] == pytest.approx(0.25)
    assert row["combined_hit_ratio"] == pytest.approx(0.5)


def test_limit_requests_beyond_the_trace_replays_it_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, f"{GOOD}\n")
    status, out, _ = _replay(capsys, "--capacity", "1000000", "--policy", "lru",
                             "--limit-requests", "50", "--json", str(path))
    assert status == 0
    row = json.loads(out)
    assert (row["requests"], row["offered_blocks"], row["hit_ratio"]) == (1, 2, 0.0)


# -- where the trace comes from and how much of it is read ---------------------------


def test_trace_from_a_pipe_is_replayed(tmp_path: Path) -> None:
    # `kvtier replay /dev/stdin` and `<(zcat t.jsonl.gz)` said "trace file not
    # found": the path exists, it is just not a regular file
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(
        [sys.executable, "-m", "kvtier", "replay", "--capacity", "4", "--policy", "lru",
         "--json", "/dev/stdin"],
        input=f"{GOOD}\n{GOOD}\n", capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    row = json.loads(run.stdout)
    assert (row["requests"], row["hit_blocks"], row["hit_ratio"]) == (2, 2, 0.5)


def test_limit_requests_reads_only_that_many(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the whole file was read (and held) before the first M were kept: a huge
    # trace cost its full memory and time, and a bad line past M stopped the run
    path = _write(tmp_path, f"{GOOD}\n{GOOD}\n{{cut short\n")
    for command in ("replay", "foresight"):
        run = _replay if command == "replay" else _foresight
        args = ("--capacity", "2", "--policy", "lru") if command == "replay" else ()
        status, out, err = run(capsys, *args, "--limit-requests", "2", str(path))
        assert status == 0, err
        assert out
    status, _, err = _replay(capsys, "--capacity", "2", "--policy", "lru",
                             "--limit-requests", "3", str(path))
    assert status == 2
    assert f"{path}:3: not valid JSON" in err


@pytest.mark.parametrize("options", [("--driver", "engine", "--concurrency", "3"),
                                     ("--store-threshold", "2"), ("--key-seed", "0-3"),
                                     ("--key-seed", "5")])
def test_policy_options_with_bounds_only_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], options: tuple[str, ...]) -> None:
    # they printed the same opt row as without them
    path = _write(tmp_path, f"{GOOD}\n")
    status, out, err = _replay(capsys, "--capacity", "2", "--policy", "opt", *options,
                               str(path))
    assert status == 2
    assert out == ""
    assert options[0] in err


@pytest.mark.parametrize(("line", "said"), [
    ('{"input_length": 512}', "the line has none"),
    ('{"hash_ids": [1, "2"]}', "got '2' at index 1"),
    ('{"hash_ids": [1, 2.5]}', "got 2.5 at index 1"),
])
def test_bad_hash_ids_say_what_the_line_has(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, said: str) -> None:
    # it said only what hash_ids must be: a missing field and one string among
    # a thousand ids read the same
    path = _write(tmp_path, f"{GOOD}\n{line}\n")
    status, _, err = _replay(capsys, "--capacity", "2", "--policy", "lru", str(path))
    assert status == 2
    assert f"{path}:2: 'hash_ids' must be a list of ints" in err and said in err


# --------------------------------------------------------- reading a long trace
def _stderr_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run ``python -m kvtier ARGV`` with stderr on a real pseudo-terminal;
    (exit status, what the terminal got)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    # a terminal of 80 columns: tqdm draws nothing on one of 0 (a new pty's size)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", *argv], stdout=subprocess.DEVNULL,
                            stderr=slave, env=env)
    os.close(slave)
    got: list[bytes] = []

    def drain() -> None:  # read while it runs: a full terminal buffer would block it
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child's end is closed
                return
            if not data:
                return
            got.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    code = proc.wait(timeout=120)
    reader.join(timeout=10)
    os.close(master)
    return code, b"".join(got).decode(errors="replace")


def test_reading_a_trace_shows_a_counter_on_a_terminal(tmp_path: Path) -> None:
    """A trace of millions of requests takes tens of seconds to read: the
    terminal shows a counter of the requests read, not silence."""
    trace = tmp_path / "many.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": [i % 50, i]}) + "\n"
                             for i in range(20_000)))
    code, terminal = _stderr_on_a_terminal(["replay", str(trace), "--capacity", "10",
                                            "--policy", "lru"])
    assert code == 0, terminal
    assert "reading many.jsonl" in terminal
    code, terminal = _stderr_on_a_terminal(["replay", str(trace), "--capacity", "10",
                                            "--policy", "lru", "--no-progress"])
    assert code == 0 and "reading" not in terminal


@pytest.mark.parametrize(("options", "said"), [
    (("--disk-blocks", "8", "--bounds"), "--disk-blocks runs the sequential driver"),
    (("--disk-blocks", "8", "--driver", "engine"), "--disk-blocks runs the sequential driver"),
    (("--disk-blocks", "8", "--block-bytes", "4096"), "--block-bytes does not apply"),
    (("--disk-store-threshold", "2",), "--disk-store-threshold needs --disk-blocks"),
    (("--gpu-blocks", "6", "--disk-blocks", "10"), "cannot be combined with --disk-blocks"),
    (("--gpu-blocks", "6", "--driver", "engine", "--preempt", "0.5"),
     "--gpu-blocks does not take --preempt"),
    (("--gpu-blocks", "6", "--gpu-batch-tokens", "64", "--driver", "engine"),
     "--gpu-batch-tokens sets the requests in flight itself"),
    (("--gpu-batch-tokens", "64"), "--gpu-batch-tokens needs --gpu-blocks"),
    # it was taken and ignored: with threshold 1 no offer count is kept
    (("--max-tracker-size", "5"), "--max-tracker-size bounds the offer counts"),
    (("--max-tracker-size", "5", "--disk-blocks", "8"), "--max-tracker-size bounds"),
])
def test_option_errors_come_before_the_trace_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], options: tuple[str, ...],
        said: str) -> None:
    # some came only after loading the trace (tens of seconds per million
    # requests); a path that does not exist shows which comes first
    status, out, err = _replay(capsys, "--capacity", "6", "--policy", "lru", *options,
                               str(tmp_path / "not-there.jsonl"))
    assert (status, out) == (2, "")
    assert said in err and "not found" not in err


def test_an_id_repeated_within_a_request_is_another_block_as_in_the_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's chained hashes make [1, 2, 1]'s third block another block than its
    # first; kept as one key, LRU with room for every block scored below the
    # infinite cache (0.5556 against 0.6667 here)
    lines = [{"hash_ids": ids} for ids in ([1, 2, 1], [1, 2, 1], [1, 2, 3], [3, 1])]
    path = _write(tmp_path, "".join(json.dumps(x) + "\n" for x in lines))
    status, out, _ = _replay(capsys, "--capacity", "5", "--policy", "lru,default", "--bounds",
                             "--json", str(path))
    assert status == 0
    ratios = {row["policy"]: row["hit_ratio"] for row in map(json.loads, out.splitlines())}
    # [1, 2, 1'] twice (3 hits the second time), [1, 2, 3] (2), [3, 1] (2: ids
    # other than repeats keep Mooncake's meaning, one id one block): 7 hits of
    # 11 offered blocks, 5 distinct blocks, all of which fit
    assert ratios == {"lru": 7 / 11, "default": 7 / 11, "opt": 7 / 11, "infinite": 7 / 11}


@pytest.mark.parametrize("threshold", [("--store-threshold", "2"),
                                       ("--disk-blocks", "8", "--disk-store-threshold", "2")])
def test_max_tracker_size_is_taken_with_a_threshold_above_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], threshold: tuple[str, ...]) -> None:
    path = _write(tmp_path, f"{GOOD}\n{GOOD}\n")
    status, out, err = _replay(capsys, "--capacity", "6", "--policy", "lru", *threshold,
                               "--max-tracker-size", "5", str(path))
    assert status == 0, err
    assert "lru" in out
