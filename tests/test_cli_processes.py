"""The command line and the processes it starts, attacked: output cut short
by its reader, interrupted writes, huge numbers, a second Ctrl-C while a
server stops, a CPU tier larger than /dev/shm. Each runs the real
``python -m kvtier`` or real processes where it can."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.server_process import ServerProcess, session_pids
from kvtier.tiers.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE (``kvtier.cli.EXIT_BROKEN_PIPE``)."""
KVTIER = [sys.executable, "-m", "kvtier"]


def _kvtier(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTIER, *argv], capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=ROOT)


def _one_line_error(proc: subprocess.CompletedProcess[str], flag: str) -> None:
    """Exit status 2 and a single ``kvtier: error: FLAG ...`` line, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "Triton" not in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvtier: error: {flag} "), lines[0]


# -- output to a reader that went away -----------------------------------------------


def test_output_cut_short_by_its_reader_ends_quietly() -> None:
    # `kvtier replay ... | head -1`: the rows after the first go to a closed pipe
    capacities = ",".join(str(c) for c in range(10, 400, 10))
    proc = subprocess.Popen([*KVTIER, "replay", "--capacity", capacities, "--policy", "lru",
                             "--limit-requests", "50"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("policy")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


# -- generate: whole file or none -----------------------------------------------------


def test_an_interrupted_generate_leaves_the_old_trace(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    old = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n'
    out.write_text(old)
    proc = subprocess.Popen([*KVTIER, "generate", "chat", "--requests", "200000", "-o",
                             str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=ENV, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until it writes: a temp file, or the trace itself
        written = [p for p in tmp_path.iterdir() if p != out and p.stat().st_size > 0]
        if written or out.read_text() != old:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert out.read_text() == old, "the trace was cut short, not left as it was"
    assert list(tmp_path.iterdir()) == [out], "a temp file was left behind"


def test_generate_to_a_directory_is_a_one_line_error(tmp_path: Path) -> None:
    proc = _kvtier("generate", "chat", "--requests", "3", "-o", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"kvtier: error: cannot write -o {tmp_path}: it is a directory"


def test_generate_still_writes_to_a_device(tmp_path: Path) -> None:
    # -o /dev/stdout: no temp file beside a device, the lines go straight to it
    proc = _kvtier("generate", "chat", "--requests", "3", "-o", "/dev/stdout")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 3


# -- numbers too large ----------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--capacity", "--gpu-blocks"])
def test_a_huge_block_count_is_a_one_line_error(flag: str) -> None:
    sizes = {"--capacity": "10", flag: str(10**20)}
    argv = ["replay", "--policy", "lru", "--limit-requests", "10"]
    _one_line_error(_kvtier(*argv, *(a for item in sizes.items() for a in item)), flag)


def test_a_huge_soak_cpu_tier_is_a_one_line_error() -> None:
    _one_line_error(_kvtier("soak", "--requests", "10", "--no-redis", "--no-progress",
                            "--cpu-blocks", str(10**20)), "--cpu-blocks")


def test_a_cpu_tier_region_without_room_names_the_capacity(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    # the tiered replay's CPU slots take capacity x 4 KiB of temp space; a
    # full file system is not to be had on demand, so its check says so here
    import kvtier.slots.region as region

    def full(directory: Path, needed: int) -> None:
        raise MemoryError(f"slot region needs {needed} bytes but {directory} has only 0 "
                          "bytes free")

    monkeypatch.setattr(region, "_check_free_space", full)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, '
                     '"hash_ids": [1, 2]}\n')
    code = main(["replay", str(trace), "--capacity", "64", "--policy", "lru",
                 "--disk-blocks", "8", "--no-progress"])
    assert code == 2
    assert capsys.readouterr().err.startswith("kvtier: error: --capacity 64: slot region needs")


def test_a_huge_max_delay_does_not_stall_the_engine_driver() -> None:
    # each completion is due up to 10**20 steps later: the driver must skip
    # the steps at which nothing can happen, not count through them
    proc = _kvtier("replay", "--capacity", "10", "--policy", "lru", "--limit-requests", "20",
                   "--driver", "engine", "--max-delay", str(10**20), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"policy": "lru"' in proc.stdout


def test_skipping_idle_steps_changes_nothing_the_driver_reports() -> None:
    # the steps skipped are those at which nothing can happen: the same
    # events at the same steps as a loop that visits every step
    from kvtier.replay import engine
    from kvtier.replay.driver import trace_keys
    from kvtier.replay.trace import BUNDLED_TRACE, load_requests

    keys = trace_keys(load_requests(BUNDLED_TRACE)[:150])
    config = engine.EngineConfig(concurrency=3, max_delay=25, preempt=0.3, resume_after=7,
                                 seed=4)
    skipping = engine.EngineStats()
    engine.replay_engine(keys, 40, "lru", config, stats=skipping, record_events=True)
    every_step = engine.EngineStats()
    original = engine._Engine._next_busy_step
    try:
        engine._Engine._next_busy_step = lambda self, in_flight: self.step  # type: ignore
        engine.replay_engine(keys, 40, "lru", config, stats=every_step, record_events=True)
    finally:
        engine._Engine._next_busy_step = original  # type: ignore[method-assign]
    assert skipping.events == every_step.events
    assert skipping.steps == every_step.steps
    assert (skipping.hits, skipping.preemptions) == (every_step.hits, every_step.preemptions)


# -- a server interrupted while it stops ---------------------------------------------

SERVER = ("import http.server, signal, subprocess, sys\n"
          "def noted(signum, frame):\n"
          "    print('SIGINT', flush=True)\n"
          "signal.signal(signal.SIGINT, noted)  # a slow shutdown: it goes on serving\n"
          "w = subprocess.Popen([sys.executable, '-c', 'import signal, time\\n"
          "signal.signal(signal.SIGINT, signal.SIG_IGN)\\n"
          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\nprint(1, flush=True)\\n"
          "time.sleep(600)'], stdout=subprocess.PIPE)\n"
          "w.stdout.readline()  # the worker ignores both signals before the server is up\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        self.send_response(200); self.end_headers()\n"
          "    def log_message(self, *a): pass\n"
          "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
PARENT = ("import signal, sys, time\n"
          "signal.signal(signal.SIGINT, signal.default_int_handler)  # a runner in the\n"
          "# background ignores SIGINT, and a child inherits that: Ctrl-C must reach it\n"
          "from kvtier.server_process import ServerProcess\n"
          "srv = ServerProcess([sys.executable, '-c', sys.argv[1], sys.argv[2]],\n"
          "                    int(sys.argv[2]), sys.argv[3], stop_timeout_s=120)\n"
          "srv.start()\n"
          "try:  # the pid is printed inside: a Ctrl-C right after it reaches stop()\n"
          "    print(srv.proc.pid, flush=True)\n"
          "    time.sleep(600)\n"
          "finally:\n"
          "    srv.stop()\n")


def test_a_second_ctrl_c_while_the_server_stops_leaves_no_process(tmp_path: Path) -> None:
    # the first Ctrl-C asks the server to stop; the impatient second one must
    # not leave its session (a worker that ignores SIGINT and SIGTERM) running
    port = free_port()
    log = tmp_path / "log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, SERVER, str(port), str(log)],
                              stdout=subprocess.PIPE, text=True, env=ENV)
    assert parent.stdout is not None
    session = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while len(session_pids(session)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = session_pids(session)
    assert len(pids) == 2, "the server and its worker"
    try:
        parent.send_signal(signal.SIGINT)
        while "SIGINT" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "SIGINT" in log.read_text(), "the server was not asked to stop"
        parent.send_signal(signal.SIGINT)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while session_pids(session) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_pids(session) == [], "the server's session outlived its parent"
    finally:
        for pid in session_pids(session):
            os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def test_a_server_stopped_without_interruption_still_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    srv = ServerProcess([sys.executable, "-c", SERVER, str(port)], port, tmp_path / "log",
                        stop_timeout_s=1)
    with srv:
        session = srv.proc.pid if srv.proc is not None else 0
    assert session_pids(session) == []
    assert len(srv.leftovers) == 1  # the worker; the server was killed after the wait


# -- kvtier serve: a CPU tier larger than /dev/shm -------------------------------------


def test_a_cpu_tier_larger_than_shared_memory_is_refused_before_vllm() -> None:
    from kvtier.host_memory import free_bytes
    from kvtier.slots.region import default_shm_dir

    too_big = free_bytes(default_shm_dir()) + (1 << 30)
    proc = _kvtier("serve", "MODEL", "--cpu-bytes", str(too_big), "--print-command")
    _one_line_error(proc, "--cpu-bytes")
    assert "free" in proc.stderr and proc.stdout == ""
    proc = _kvtier("serve", "MODEL", "--kvtier", f"cpu_bytes_to_use={too_big}",
                   "--print-command")
    _one_line_error(proc, "cpu_bytes_to_use")


def test_a_setting_given_twice_as_kvtier_is_refused() -> None:
    # Fault: `--kvtier disk_bytes=1G --kvtier disk_bytes=10G` silently kept the
    # last one (a flag and --kvtier for the same key were already refused).
    proc = _kvtier("serve", "MODEL", "--kvtier", "store_threshold=2",
                   "--kvtier", "store_threshold=3", "--print-command")
    assert proc.returncode == 2 and "store_threshold given twice" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_a_negative_soak_disk_tier_names_the_flag() -> None:
    # Fault: `soak --disk-blocks -5` was refused as "disk_blocks", not by its flag.
    proc = _kvtier("soak", "--disk-blocks", "-5")
    assert proc.returncode == 2 and "--disk-blocks" in proc.stderr, proc.stderr


# -- exit statuses: a size past what the process may use is bad input --------------


def test_foresight_refuses_gpu_blocks_past_memory_before_reading_the_trace(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    assert main(["foresight", "--gpu-blocks", str(10**11), "--limit-requests", "10",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: --gpu-blocks 100000000000:"), err


def test_demo_refuses_cpu_bytes_past_shared_memory_before_starting_an_engine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm")
    from kvtier.cli import main
    from kvtier.demo import chat
    from kvtier.host_memory import free_bytes
    from kvtier.slots.region import default_shm_dir

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo went on to build the model and start vLLM")

    monkeypatch.setattr(chat, "_model", started)
    monkeypatch.setattr(chat, "run_engine", started)
    too_many = free_bytes(default_shm_dir()) + (1 << 30)
    for extra in ([], ["--disk", "/nonexistent-kvtier-demo-dir"]):
        assert main(["demo", "--cpu-bytes", str(too_many), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvtier: error: --cpu-bytes {too_many}: the CPU tier lives in")
        assert err.count("\n") == 1


def test_a_spec_key_given_twice_is_refused_once_is_kept() -> None:
    # spec_name / spec_module_path may name a wrapper of KVTierSpec (the fault
    # runs' kvtier.bench.fault_spec does), but not twice
    proc = _kvtier("serve", "MODEL", "--kvtier", "spec_name=SlowDiskSpec",
                   "--kvtier", "spec_name=Other", "--print-command")
    assert proc.returncode == 2 and "spec_name given twice" in proc.stderr, proc.stderr
    proc = _kvtier("serve", "MODEL", "--kvtier", "spec_name=SlowDiskSpec",
                   "--kvtier", "spec_module_path=kvtier.bench.fault_spec", "--print-command")
    assert proc.returncode == 0, proc.stderr
    assert '"spec_name":"SlowDiskSpec"' in proc.stdout.replace(" ", ""), proc.stdout
