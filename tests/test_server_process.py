"""ServerProcess (kvtier.server_process) with small real commands: a Python
HTTP server stands in for vLLM's, which tests/test_serve_e2e.py starts for real."""

from __future__ import annotations

import http.server
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.server_process import KEEP_ALIVE_ENV, KEEP_ALIVE_S, ServerError, ServerProcess
from kvtier.tiers.redis_server import free_port

HEALTHY = ("import http.server, sys\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200); self.end_headers()\n"
           "    def log_message(self, *a): pass\n"
           "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def gone(pid: int) -> bool:
    """Not running (or a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_server_that_answers_is_ready_and_stops(tmp_path: Path) -> None:
    port = free_port()
    srv = ServerProcess([sys.executable, "-c", HEALTHY, str(port)], port, tmp_path / "log")
    with srv, urllib.request.urlopen(srv.url + "/health", timeout=5) as r:
        assert r.status == 200
    assert srv.leftovers == []


def test_servers_keep_idle_connections_past_the_clients_unless_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_ALIVE_ENV, raising=False)
    argv, port = [sys.executable, "-c", "pass"], free_port()
    assert ServerProcess(argv, port, "log").env[KEEP_ALIVE_ENV] == str(KEEP_ALIVE_S)
    assert ServerProcess(argv, port, "log", env={"A": "1"}).env == {
        "A": "1", KEEP_ALIVE_ENV: str(KEEP_ALIVE_S)}
    told = {KEEP_ALIVE_ENV: "9"}
    assert ServerProcess(argv, port, "log", env=told).env == told
    monkeypatch.setenv(KEEP_ALIVE_ENV, "11")
    assert ServerProcess(argv, port, "log").env[KEEP_ALIVE_ENV] == "11"


def test_another_server_on_the_port_is_not_taken_for_this_one(tmp_path: Path) -> None:
    # the port was free when chosen; something else took it before this server
    # (vLLM binds after loading its model) could: its answers are not ours
    port = free_port()
    foreign = http.server.HTTPServer(("127.0.0.1", port), Healthy)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        srv = ServerProcess([sys.executable, "-c", "import time; time.sleep(1.5)"], port,
                            tmp_path / "log", ready_timeout_s=30)
        with pytest.raises(ServerError, match="exited with status 0 before it was ready"):
            srv.start()
    finally:
        foreign.shutdown()
        foreign.server_close()


def test_a_server_that_fails_to_start_leaves_no_process(tmp_path: Path) -> None:
    # its main process exits, what it spawned (vLLM's engine core) must not run on
    srv = ServerProcess(["sh", "-c", "sleep 60 & exit 3"], free_port(), tmp_path / "log")
    with pytest.raises(ServerError, match="status 3"):
        srv.start()
    assert len(srv.leftovers) == 1
    deadline = time.monotonic() + 10
    while not gone(srv.leftovers[0]):
        assert time.monotonic() < deadline, "the spawned process still runs"
        time.sleep(0.05)


def test_redis_server_on_a_taken_port_fails_to_start() -> None:
    pytest.importorskip("redis")
    from kvtier.tiers.redis_server import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server")
    port = free_port()
    foreign = http.server.HTTPServer(("127.0.0.1", port), Healthy)
    try:
        srv = RedisServer(port=port)
        with pytest.raises(RuntimeError, match="exited early"):
            srv.start()  # the port answered, but not this server
        srv.close()
    finally:
        foreign.server_close()


def test_redis_server_password_is_quoted_and_never_shown() -> None:
    redis = pytest.importorskip("redis")
    from kvtier.tiers.redis_server import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server")
    password = 'pa ss"word'
    srv = RedisServer(password=password)
    assert srv._dir_path is None  # no directory before a start
    with srv:
        client = redis.Redis(port=srv.port, password=password)
        assert client.ping()
        client.close()
        made = Path(srv._dir)
    assert not made.exists()  # removed by close
    assert password not in RedisServer(password=password).log_tail()


PARENT = ("import sys, time\n"
          "from kvtier.server_process import ServerProcess\n"
          "srv = ServerProcess([sys.executable, '-c', sys.argv[1], sys.argv[2]],\n"
          "                    int(sys.argv[2]), sys.argv[3])\n"
          "srv.start()\n"
          "print(srv.proc.pid, flush=True)\n"
          "time.sleep(600)\n")


def test_a_server_does_not_outlive_a_killed_parent(tmp_path: Path) -> None:
    # SIGKILL (the OOM killer, a CI timeout) runs no finally block: the server,
    # in its own session, must still stop with the process that started it
    import signal
    import subprocess

    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, HEALTHY, str(port),
                               str(tmp_path / "log")], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    server = int(parent.stdout.readline())
    assert not gone(server)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not gone(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server), "the server outlived the process that started it"


WORKER = ("import signal, sys, time\n"
          "from kvtier.slots.region import SlotRegion\n"
          "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
          "r = SlotRegion.create('reap-test', 2, 4096, shm_dir=sys.argv[1], reaper=True,\n"
          "                      populate=False)\n"
          "print(r.path, flush=True)\n"
          "time.sleep(600)\n")
WITH_WORKER = ("import subprocess, sys\n"
               "subprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[3]],\n"
               "                 stdout=open(sys.argv[4], 'w'))\n" + HEALTHY)


def test_a_worker_killed_at_stop_leaves_no_slot_region(tmp_path: Path) -> None:
    # a worker that does not stop on SIGINT is killed with the session; its
    # region's reaper must outlive it long enough to remove the region
    port = free_port()
    where = tmp_path / "region-path"
    srv = ServerProcess([sys.executable, "-c", WITH_WORKER, str(port), WORKER,
                         str(tmp_path), str(where)], port, tmp_path / "log",
                        stop_timeout_s=1)
    with srv:
        deadline = time.monotonic() + 30
        while not where.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        region = Path(where.read_text().strip())
        assert region.exists()
    assert srv.leftovers, "the worker should have been left to kill"
    deadline = time.monotonic() + 5
    while region.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not region.exists()
