"""One OpenAI-compatible server process: started in its own session, waited
for, stopped cleanly, and checked for leftovers.

vLLM's server runs as several processes (API server, engine core, workers).
``ServerProcess`` starts the command in a new session so that every process it
spawns can be found (``/proc/<pid>/stat``'s session id) and none outlives
``stop``: a clean stop is SIGINT to the server, which shuts its engine down;
whatever still runs after ``stop_timeout_s`` is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

LOG_TAIL_BYTES = 6000

KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
KEEP_ALIVE_S = 75
"""How long a server started here keeps an idle HTTP connection open (vLLM's
own default is 5 s), unless the caller's environment sets ``KEEP_ALIVE_ENV``:
longer than the harness's clients keep one for reuse (``vllm bench serve``
60 s in vLLM 0.32, the ``openai`` client's httpx 5 s), so that the client
always closes an idle connection first. A request sent on a pooled
connection as the server closed it failed in the client ("Server
disconnected"): 1 of 150 requests of a fault run with no fault, and most
likely the 2-16 of 3,993 per serving run seen before."""


class ServerError(RuntimeError):
    """The server did not start or stop as expected; the message holds its log's tail."""


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises ``SystemExit`` meanwhile, so that ``finally`` blocks stop the
    servers a benchmark started (Python's default would leave them running).
    Off the main thread, where Python cannot set a handler, it changes nothing."""
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kill(pids: Sequence[int]) -> None:
    """SIGKILL each of ``pids`` still running."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1


def _terminate_with_parent() -> None:
    """In the child, before it runs the server: SIGTERM when the thread that
    started it ends (Linux ``PR_SET_PDEATHSIG``), so that a killed benchmark,
    demo or test (SIGKILL, the OOM killer, a CI timeout) leaves no server
    running in its own session. Best effort: nothing where ``prctl`` is
    missing. (The server's own processes are its to stop on SIGTERM.)"""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def session_pids(session: int) -> list[int]:
    """Processes of session ``session`` still alive (zombies excluded)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            out.append(int(entry.name))
    return out


def _wait_gone(pids: list[int], session: int, seconds: float) -> None:
    """Wait up to ``seconds`` until none of ``pids`` is alive in ``session``:
    SIGKILL takes effect asynchronously, and a process being killed still
    shows (not yet a zombie) for a moment after ``kill`` returns."""
    deadline = time.monotonic() + seconds
    while set(pids) & set(session_pids(session)) and time.monotonic() < deadline:
        time.sleep(0.05)


_TCP_LISTEN = "0A"


def listening_sockets(port: int) -> set[str] | None:
    """Inodes of the TCP sockets listening on ``port`` (IPv4 and IPv6); None
    when ``/proc/net`` cannot tell."""
    found: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if (len(fields) > 9 and fields[3] == _TCP_LISTEN
                    and int(fields[1].rsplit(":", 1)[1], 16) == port):
                found.add(fields[9])
    return found if readable else None


def process_holds_socket(pid: int, inodes: set[str]) -> bool:
    """Whether process ``pid`` has one of the socket ``inodes`` open."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(fd.path) in wanted:
                    return True
    return False


def session_holds_socket(session: int, inodes: set[str]) -> bool:
    """Whether a process of ``session`` has one of the socket ``inodes`` open."""
    return any(process_holds_socket(pid, inodes) for pid in session_pids(session))


class ServerProcess:
    """A server command, its port and log file; a context manager (start/stop).

    Owns the process and its session: after ``stop`` no process of the session
    runs (``leftovers`` says which did before they were killed). Its
    environment is ``env`` (default: this process's), with ``KEEP_ALIVE_S``
    unless that sets ``KEEP_ALIVE_ENV``.
    """

    def __init__(self, argv: Sequence[str], port: int, log_path: str | Path,
                 env: Mapping[str, str] | None = None, ready_timeout_s: float = 300.0,
                 stop_timeout_s: float = 60.0) -> None:
        self.argv = list(argv)
        self.port = port
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault(KEEP_ALIVE_ENV, str(KEEP_ALIVE_S))
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.leftovers: list[int] = []
        self.returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Start the command and wait until ``/health`` answers 200 while it runs.

        However the wait ends without a ready server (its exit, the timeout,
        an interrupt), what the command started is stopped before this returns
        or raises: it runs in its own session, where a Ctrl-C of the terminal
        never reaches it.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True,
                                         preexec_fn=_terminate_with_parent)
        try:
            self._wait_ready(self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerError(f"server exited with status {proc.returncode} "
                                  f"before it was ready:\n{self.log_tail()}")
            if self._healthy() and self._owns_port(proc.pid):
                return
            time.sleep(0.5)
        raise ServerError(f"server not ready after {self.ready_timeout_s:.0f} s:\n"
                          f"{self.log_tail()}")

    def _owns_port(self, session: int) -> bool:
        """Whether the server answering on the port is this one: another
        process may have taken the port meanwhile (it was free when chosen),
        and this server will then fail to bind it. True when /proc cannot tell."""
        inodes = listening_sockets(self.port)
        if inodes is None:
            return True
        return bool(inodes) and session_holds_socket(session, inodes)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> int:
        """SIGINT, wait, then kill what is left of the session; the exit status.

        Interrupted while it waits (a second Ctrl-C, SIGTERM under
        ``sigterm_as_exit``), it kills the session at once before the
        interruption goes on: the server is in a session of its own, which
        no signal of the terminal reaches, and it would outlive this process."""
        proc = self.proc
        if proc is None:
            return 0
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.returncode = proc.returncode
            self.leftovers = self._reap_session(proc.pid)
        except BaseException:
            self.leftovers = self._kill_session(proc)
            raise
        finally:
            self.proc = None
        return self.returncode

    def _kill_session(self, proc: subprocess.Popen[bytes]) -> list[int]:
        """Kill the server and every process of its session now (reapers a
        moment after the rest, as ``_reap_session`` does); the pids killed."""
        from kvtier.slots.reaper import is_reaper

        proc.kill()
        left = session_pids(proc.pid)
        reapers = [pid for pid in left if is_reaper(pid)]
        _kill([pid for pid in left if pid not in reapers])
        proc.wait()
        time.sleep(0.2)  # a reaper removes its region once its worker is gone
        _kill(reapers)
        self.returncode = proc.returncode
        return left

    def _reap_session(self, session: int) -> list[int]:
        """Wait briefly for the session to empty; kill and return what remains.

        Region reapers are killed last, a moment after the rest: a reaper
        removes its slot region once the worker that made it is gone, and
        killing both at once would leave the region in /dev/shm."""
        from kvtier.slots.reaper import is_reaper

        deadline = time.monotonic() + 10.0
        while (left := session_pids(session)) and time.monotonic() < deadline:
            time.sleep(0.2)
        reapers = [pid for pid in left if is_reaper(pid)]
        killed = [pid for pid in left if pid not in reapers]
        _kill(killed)
        _wait_gone(killed + reapers, session, 2.0)
        _kill([p for p in reapers if p in session_pids(session)])
        _wait_gone(left, session, 2.0)
        return left

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-LOG_TAIL_BYTES:].decode(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
