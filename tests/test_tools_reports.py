"""The operator and benchmark tools' reports: each
test names what a reported figure got wrong, and failed on the code before its
fix. The Redis tests run a real redis-server; the drill load runs against a
small real HTTP server that answers as vLLM's completions endpoint does."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import threading
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers.bench_runs import run_result
from test_tools import run

from kvtier.bench import drill_engine, serving
from kvtier.bench.disk_drill import DiskDrillReport, DiskRound
from kvtier.bench.drill_engine import Load
from kvtier.bench.faults import HEADER, FaultResult, table

# ------------------------------------------------------------ bench serve's table


def test_the_serving_table_says_done_and_fail_are_totals_not_medians(tmp_path: Path) -> None:
    """Under "bundled trace, paced (medians of 3 runs)" the `done` and `fail`
    columns were sums over the runs (3 x 10 requests read "30"): the heading
    claimed a median for every column. They stay totals (a median would hide
    a failure in one run of three) and the heading says so."""
    settings = serving.BenchSettings(model=tmp_path / "m", out=tmp_path / "o",
                                     configs=("vllm-lru", "lru"), traffic=("bundled",),
                                     regimes=("paced",), cpu_blocks=(1000,), repeats=3)
    results = [run_result(c, r) for c in ("vllm-lru", "lru") for r in range(3)]
    results[-1] = run_result("lru", 2, completed=8, failed=2)
    rows = serving.summarize(results, settings)
    lru = next(r for r in rows if r.config == "lru")
    assert (lru.completed, lru.failed) == (28, 2)  # totals, as the heading must say
    lines = list(serving.table(rows))
    heading = next(line for line in lines if line.startswith("bundled trace"))
    assert "medians of 3 runs" in heading
    assert "done, fail and switched: totals" in heading, heading
    # an interrupted benchmark's heading says it too
    interrupted = [rows[0], dataclasses.replace(lru, repeats=2)]
    heading = next(line for line in serving.table(interrupted)
                   if line.startswith("bundled trace"))
    assert "2-3 runs" in heading and "done, fail and switched: totals" in heading, heading


# ------------------------------------------------------------ the faults table
def _fault(fault: str, **fields: Any) -> FaultResult:
    base: dict[str, Any] = dict(fault=fault, completed=10, failed=0, ttft_p99_ms=100.0,
                                ttft_max_ms=120.0, kvtier_tokens=500.0, probe_answer="a")
    base.update(fields)
    return FaultResult(**base)


def _cells(line: str) -> dict[str, str]:
    return dict(zip(HEADER, line.split(), strict=True))


def test_clean_ratio_is_not_a_figure_when_the_reference_measured_no_ttft() -> None:
    """A reference run in which no request completed reports a p99 TTFT of 0:
    every run's `/clean` read "0.00" (a ratio that looks measured: faster than
    clean) and `max-clean p99` the run's max TTFT minus 0."""
    lines = table([_fault("none", completed=0, failed=10, ttft_p99_ms=0.0, ttft_max_ms=0.0),
                   _fault("redis-stop")])
    clean, stopped = _cells(lines[1]), _cells(lines[2])
    assert stopped["/clean"] == "-" and stopped["max-clean p99"] == "-", lines
    assert clean["/clean"] == "-" and clean["p99 TTFT"] == "-", lines
    assert stopped["p99 TTFT"] == "100ms"


def test_lost_is_never_negative_and_a_run_that_served_more_is_named() -> None:
    """`lost` is the share of the reference run's kvtier tokens a faulted run
    lost; a run that served more (runs vary) showed "-10%" lost. It shows 0 %,
    and a note says which run served how much more; with no reference tokens
    there is no share: "-"."""
    lines = table([_fault("none"), _fault("disk-slow", kvtier_tokens=550.0),
                   _fault("redis-kill", kvtier_tokens=125.0)])
    assert _cells(lines[2])["lost"] == "0%", lines
    assert _cells(lines[3])["lost"] == "75%", lines
    note = [line for line in lines if "served more" in line]
    assert note and "disk-slow +10%" in note[0] and "redis-kill" not in note[0], lines
    lines = table([_fault("none", kvtier_tokens=0.0), _fault("disk-slow")])
    assert _cells(lines[2])["lost"] == "-", lines


# ------------------------------------------------------------ disk drill totals
def test_drill_totals_do_not_count_unchecked_answers_as_identical() -> None:
    """`totals()["answers_identical"]` was `all(r.fixed_identical is not
    False)`: a writer-only drill, which asks no engine anything, reported its
    answers identical. Only rounds whose answers were compared count; the
    others are reported apart."""
    writer_only = DiskDrillReport(seed=0, with_engine=False, writer_mode="disk",
                                  rounds=[DiskRound(1, 1.0), DiskRound(2, 1.0)])
    t = writer_only.totals()
    assert t["answers_identical"] == 0 and t["answers_identical"] is not True, t
    assert (t["answers_checked"], t["answers_unchecked"]) == (0, 2)
    mixed = DiskDrillReport(seed=0, with_engine=True, writer_mode="disk", rounds=[
        DiskRound(1, 1.0, fixed_identical=True), DiskRound(2, 1.0, fixed_identical=False),
        DiskRound(3, 1.0)])
    t = mixed.totals()
    assert (t["answers_checked"], t["answers_identical"], t["answers_unchecked"]) == (2, 1, 1)
    assert json.dumps(mixed.to_dict())  # still JSON


# ------------------------------------------------------------ the drill load
class _Completions(BaseHTTPRequestHandler):
    """``POST /v1/completions`` as vLLM answers it; every 5th request an HTTP 500."""

    protocol_version = "HTTP/1.1"
    counter = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            type(self).counter += 1
            n = self.counter
        if n % 5 == 0:
            self._reply(500, {"error": {"message": "engine dead", "type": "x", "code": 500}})
        else:
            self._reply(200, {"id": f"c{n}", "object": "text_completion", "created": 0,
                              "model": "m", "choices": [{"index": 0, "text": "ab",
                                                         "finish_reason": "length",
                                                         "logprobs": None}]})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def completions_url() -> Iterator[str]:
    pytest.importorskip("openai")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _held(obj: Any, depth: int = 2) -> int:
    """Items in the containers ``obj`` holds (and those of its dataclasses)."""
    total = 0
    for value in vars(obj).values():
        if isinstance(value, list | tuple | dict | set | deque):
            total += len(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and depth:
            total += _held(value, depth - 1)
    return total


def test_the_drill_load_holds_counts_not_one_outcome_per_request(
        completions_url: str) -> None:
    """`Load` appended an outcome per request for the whole drill (a Redis
    drill's load runs for minutes, thousands of requests): memory grew with
    the drill's length. It keeps counts, and describes the first failures."""
    load = Load(completions_url, Path("m"), seed=0, threads=2, pool=[[5, 6, 7]],
                pool_answers=["xy"], distinct_share=0.5, distinct_tokens=(4, 8),
                timeout_s=10).start()
    try:
        assert load.wait_completed(40, timeout_s=60)
        early = _held(load)
        snapshot = load.stats()
        assert load.wait_completed(160, timeout_s=120)
    finally:
        load.stop()
    assert _held(load) <= early, "the load's memory grows with its requests"
    stats = load.stats()
    assert stats.requests >= 200 and stats.requests == stats.ok + stats.failed
    assert stats.failed >= stats.requests // 5 - 2 and stats.wrong > 0  # answers "ab", not "xy"
    assert stats.errors == ["HTTP 500"] * drill_engine.MAX_LOAD_ERRORS
    assert snapshot.requests < stats.requests  # a snapshot: later requests left it alone


# ------------------------------------------------------------ redis inspect


def test_keys_of_namespaces_past_the_limit_are_not_called_foreign(
        redis_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """`redis inspect` counts MAX_NAMESPACES (10,000) namespaces one by one; the
    keys of further ones went to `other_keys`, printed as "other keys under
    kvtier: (not kvtier:<namespace>:<key> strings)", which they are: kvtier
    blocks, left out of the "of N keys in the database are kvtier blocks" too."""
    import redis

    from kvtier.tools.redis_admin import MAX_NAMESPACES

    extra = 5
    raw = redis.Redis.from_url(redis_server.url)
    pipe = raw.pipeline(transaction=False)
    for i in range(MAX_NAMESPACES + extra):
        pipe.set(f"kvtier:ns-{i:05d}:block".encode(), b"v" * 10)
    pipe.set(b"kvtier:not a namespace", b"x")
    pipe.execute()
    raw.close()

    code, out, err = run(capsys, "redis", "inspect", redis_server.url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["total"]["namespaces"] == MAX_NAMESPACES
    assert report["other_keys"] == 1, report["other_keys"]  # only the malformed one
    assert report["overflow"]["keys"] == extra and report["overflow"]["value_bytes"] == 50

    code, out, err = run(capsys, "redis", "inspect", redis_server.url)
    assert code == 0, err
    assert "1 other key under kvtier:" in out, out[-600:]
    assert f"{extra} more keys (50 B) in namespaces found after the first 10,000" in out, out[-600:]
    total = MAX_NAMESPACES + extra + 1
    assert f"{MAX_NAMESPACES + extra} of {total} keys in the database are kvtier" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_redis_inspect_shows_its_scan_going_on_a_terminal(
        redis_server: Any, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`disk verify` shows a progress bar on a terminal; `redis inspect`, whose
    SCAN of a large database takes thousands of calls, showed nothing until
    the end. It counts the keys found and the calls made (stderr, a terminal
    only; `--no-progress` turns it off); stdout is the report alone."""
    pytest.importorskip("tqdm")
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    raw.mset({f"kvtier:ns-a:{i}".encode(): b"v" for i in range(300)})
    raw.close()
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code, out, _ = run(capsys, "redis", "inspect", redis_server.url, "--scan-count", "20")
    assert code == 0 and out.startswith("redis tier ")
    shown = terminal.getvalue()
    assert "SCAN call" in shown and "key" in shown, shown[-300:]
    assert "SCAN call" not in out

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code, out, _ = run(capsys, "redis", "inspect", redis_server.url, "--no-progress")
    assert code == 0 and terminal.getvalue() == ""
