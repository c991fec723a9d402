"""The trace recorder (``kvtier.replay.recorder``): Mooncake lines of the
requests an engine finished, read back by the trace reader. The engine's own
recording is ``tests/test_vllm_trace_recording.py``."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvtier import block_key
from kvtier.keys import key_hash
from kvtier.replay import recorder as R
from kvtier.replay.trace import load_trace
from kvtier.vllm.settings import ConfigError, KVTierSettings


def positions(hashes: list[int], group: int = 0, tokens: int = 32) -> list[tuple[bytes, int]]:
    return [(block_key(h, group), (i + 1) * tokens) for i, h in enumerate(hashes)]


def test_a_line_lists_the_blocks_in_prefix_order_whatever_order_they_came_in() -> None:
    keys = positions([11, 12, 13])
    line = R.trace_line(7.6, [keys[2], keys[0], keys[1]])
    assert line is not None
    obj = json.loads(line)
    ids = [R.trace_hash_id(key_hash(block_key(h))) for h in (11, 12, 13)]
    assert obj == {"timestamp": 8, "input_length": 3 * 512, "output_length": 1, "hash_ids": ids}
    assert len(set(ids)) == 3 and all(0 <= i < 1 << 64 for i in ids)
    # another KV-cache group's keys of the same blocks add no block
    assert R.trace_line(7.6, keys + positions([11, 12, 13], group=1)) == line
    assert R.trace_line(0.0, []) is None


def test_the_recorder_writes_a_trace_the_reader_takes(tmp_path: Path) -> None:
    rec = R.TraceRecorder(tmp_path / "t.jsonl")
    rec.record(0.0, positions([1, 2, 3]))
    rec.record(5.0, positions([1, 2, 4, 5]))
    rec.record(6.0, [])  # no full block: left out
    rec.close()
    got = load_trace(tmp_path / "t.jsonl")
    assert [r.timestamp for r in got] == [0, 5]
    assert [r.input_length for r in got] == [3 * 512, 4 * 512]  # Mooncake's blocks
    assert got[0].hash_ids[:2] == got[1].hash_ids[:2] and got[0].hash_ids[2] != got[1].hash_ids[2]
    assert rec.stats() == {"recorded": 2, "dropped": 0, "stopped": True}


def _clock(rec: R.TraceRecorder, *stamps: float) -> None:
    """Arrival stamps on demand, in order (the real clock may repeat one)."""
    rec.now_ms = iter(stamps).__next__  # type: ignore[method-assign]


def _stamps(path: Path) -> list[int]:
    return [json.loads(line)["timestamp"] for line in path.read_text().splitlines()]


def _wait_for_lines(path: Path, n: int) -> None:
    for _ in range(500):
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.01)


def test_lines_come_out_in_arrival_order_not_finish_order(tmp_path: Path) -> None:
    # it wrote them as they finished: a long request after later short ones
    path = tmp_path / "t.jsonl"
    rec = R.TraceRecorder(path)
    _clock(rec, 10.0, 20.0, 30.0, 40.0)
    a, b, c, d = (rec.arrive() for _ in range(4))
    rec.record(c, positions([3]))
    rec.record(b, positions([2]))
    _wait_for_lines(path, 1)
    time.sleep(0.05)
    assert _stamps(path) == []  # a, which arrived first, still runs: b and c wait
    rec.record(a, positions([1]))
    _wait_for_lines(path, 3)
    assert _stamps(path) == [10, 20, 30]  # a finished: all three, in arrival order
    rec.record(d, positions([4]))
    rec.close()
    assert _stamps(path) == [10, 20, 30, 40]
    assert rec.stats() == {"recorded": 4, "dropped": 0, "stopped": True}


def test_a_finish_never_reported_holds_lines_back_only_within_bounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R, "MAX_REORDER", 3)
    path = tmp_path / "t.jsonl"
    rec = R.TraceRecorder(path)
    _clock(rec, *map(float, range(10)))
    lost = rec.arrive()  # its finish never comes
    later = [rec.arrive() for _ in range(5)]
    for stamp in later:
        rec.record(stamp, positions([int(stamp)]))
    _wait_for_lines(path, 2)
    assert _stamps(path) == [1, 2]  # past MAX_REORDER held lines, the oldest go out
    rec.close()  # the lines still held are written at close
    assert _stamps(path) == [1, 2, 3, 4, 5] and lost == 0.0


def test_arrivals_waited_for_are_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R, "MAX_RUNNING", 2)
    path = tmp_path / "t.jsonl"
    rec = R.TraceRecorder(path)
    _clock(rec, 1.0, 2.0, 3.0)
    rec.arrive()  # never finishes, and falls out of the running stamps...
    second, third = rec.arrive(), rec.arrive()
    assert list(rec._running) == [2.0, 3.0]
    rec.record(third, positions([3]))
    rec.record(second, positions([2]))
    _wait_for_lines(path, 2)  # ...so nothing waits for it
    assert _stamps(path) == [2, 3]
    rec.close()


def test_recording_stops_after_max_requests(tmp_path: Path) -> None:
    rec = R.TraceRecorder(tmp_path / "t.jsonl", max_requests=3)
    rec.record(0.5, [])  # no full block: counts for no line
    for i in range(10):
        rec.record(float(i), positions([100 + i]))
    rec.close()
    assert [r.timestamp for r in load_trace(tmp_path / "t.jsonl")] == [0, 1, 2]


def test_a_writer_behind_drops_requests_and_never_blocks_the_caller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow disk, on demand: the writer waits on the first line until released.
    release = threading.Event()
    real = R.trace_line

    def slow_line(*args: object) -> str | None:
        release.wait(10)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(R, "trace_line", slow_line)
    rec = R.TraceRecorder(tmp_path / "t.jsonl")
    for i in range(R.MAX_QUEUED + 50):
        rec.record(float(i), positions([i]))
    assert 49 <= rec.dropped <= 50  # the queue's room, plus the one the writer holds
    release.set()
    rec.close()
    assert len(load_trace(tmp_path / "t.jsonl")) == R.MAX_QUEUED + 50 - rec.dropped


def test_a_write_error_stops_recording_without_raising(tmp_path: Path) -> None:
    rec = R.TraceRecorder(tmp_path / "t.jsonl")
    rec._file.close()
    rec._file = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 (ENOSPC on flush)
    rec.record(0.0, positions([1]))
    rec.close()
    assert rec.stats() == {"recorded": 0, "dropped": 0, "stopped": True}
    rec.record(1.0, positions([2]))  # after close: ignored


def test_an_existing_or_unwritable_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old.jsonl").write_text("keep me\n")
    with pytest.raises(R.TraceRecorderError, match="exists: a trace is never overwritten"):
        R.TraceRecorder(tmp_path / "old.jsonl")
    assert (tmp_path / "old.jsonl").read_text() == "keep me\n"
    (tmp_path / "empty.jsonl").touch()  # left by a start that failed: taken over
    R.TraceRecorder(tmp_path / "empty.jsonl").close()
    with pytest.raises(R.TraceRecorderError, match="cannot create it"):
        R.TraceRecorder(tmp_path / "no-such-dir" / "t.jsonl")
    with pytest.raises(ValueError, match="max_requests must be an int >= 1"):
        R.TraceRecorder(tmp_path / "t.jsonl", max_requests=0)


def test_pid_in_the_path_gives_each_engine_its_own_file(tmp_path: Path) -> None:
    rec = R.TraceRecorder(tmp_path / "trace-{pid}.jsonl")
    rec.close()
    assert rec.path == tmp_path / f"trace-{os.getpid()}.jsonl" and rec.path.exists()


def test_trace_settings_are_checked(tmp_path: Path) -> None:
    base = {"cpu_bytes_to_use": 1 << 20}
    s = KVTierSettings.from_extra_config({**base, "trace_path": "~/t.jsonl"})
    assert s.trace_path == os.path.expanduser("~/t.jsonl") and s.trace_max_requests == 100_000
    with pytest.raises(ConfigError, match=r"\['trace_max_requests'\] set but trace_path is not"):
        KVTierSettings.from_extra_config({**base, "trace_max_requests": 10})
    with pytest.raises(ConfigError, match="trace_max_requests must be an int >= 1"):
        KVTierSettings.from_extra_config({**base, "trace_path": "t", "trace_max_requests": 0})
    with pytest.raises(ConfigError, match="trace_path must be a non-empty str"):
        KVTierSettings.from_extra_config({**base, "trace_path": ""})
