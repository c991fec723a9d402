"""A throw-away local ``redis-server`` / ``valkey-server`` (tests, benchmarks, demos).

Listens on a free loopback port only, without persistence (``save ""``,
``appendonly no``), and dies with the process that started it. The
configuration, password included, is passed on the server's standard input, so
it never appears in a process listing.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from kvtier.server_process import listening_sockets, process_holds_socket

SERVER_BINARIES = ("redis-server", "valkey-server")
SERVER_ENV = "KVTIER_REDIS_SERVER"
"""Environment variable naming the server binary to use instead of PATH's."""


def find_server_binary() -> str | None:
    """``$KVTIER_REDIS_SERVER``, else ``redis-server`` or ``valkey-server`` on PATH."""
    configured = os.environ.get(SERVER_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for name in SERVER_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the process that started it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for a TLS listener (the CA signs the server certificate)."""

    cert: Path
    key: Path
    ca: Path


class RedisServer:
    """One server process; ``start()``/``stop()``/``restart()`` keep the port.

    ``pause()``/``resume()`` stop and continue the process (SIGSTOP/SIGCONT): a
    server that accepts connections but never answers, for timeout tests.
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        tls: TLSFiles | None = None,
        config: dict[str, str] | None = None,
        binary: str | None = None,
        port: int | None = None,
    ) -> None:
        found = binary or find_server_binary()
        if found is None:
            raise FileNotFoundError(
                "no redis-server or valkey-server found (install Debian's redis-server, "
                f"or set {SERVER_ENV})"
            )
        self.binary = found
        self.password = password
        self.tls = tls
        self.config = dict(config or {})
        self.port = port or free_port()
        self._dir_path: str | None = None  # made by the first start, removed by close
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def _dir(self) -> str:
        if self._dir_path is None:
            self._dir_path = tempfile.mkdtemp(prefix="kvtier-redis-")
        return self._dir_path

    @property
    def url(self) -> str:
        """URL without the password (pass it separately or add it yourself)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _config_text(self) -> str:
        lines = {
            "bind": "127.0.0.1",
            "protected-mode": "yes",
            "save": '""',
            "appendonly": "no",
            "dir": self._dir,
            "daemonize": "no",
            "logfile": '""',
            "databases": "4",
        }
        if self.tls:
            lines.update(
                {
                    "port": "0",
                    "tls-port": str(self.port),
                    "tls-cert-file": str(self.tls.cert),
                    "tls-key-file": str(self.tls.key),
                    "tls-ca-cert-file": str(self.tls.ca),
                    "tls-auth-clients": "no",
                }
            )
        else:
            lines["port"] = str(self.port)
        if self.password is not None:  # quoted: a space or quote is part of it
            escaped = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines["requirepass"] = f'"{escaped}"'
        lines.update(self.config)
        return "".join(f"{k} {v}\n" for k, v in lines.items())

    def start(self, timeout_s: float = 10.0) -> Self:
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = open(Path(self._dir) / "server.log", "ab")  # noqa: SIM115 (kept by Popen)
        self.proc = subprocess.Popen(
            [self.binary, "-"], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        log.close()
        atexit.register(self.close)
        assert self.proc.stdin is not None
        self.proc.stdin.write(self._config_text().encode())
        self.proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited early: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    pass
            except OSError:
                time.sleep(0.02)
                continue
            if self._listens():
                return self
            time.sleep(0.02)  # another process's port: this server will fail to bind
        self.stop()
        raise TimeoutError(f"{self.binary} did not listen on port {self.port}: {self.log_tail()}")

    def _listens(self) -> bool:
        """Whether this server holds the socket listening on its port (True when
        /proc cannot tell)."""
        inodes = listening_sockets(self.port)
        if inodes is None:
            return True
        return (self.proc is not None and bool(inodes)
                and process_holds_socket(self.proc.pid, inodes))

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's log, its password hidden."""
        if self._dir_path is None:
            return ""
        try:
            text = (Path(self._dir_path) / "server.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""
        return text.replace(self.password, "***") if self.password else text

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGKILL with ``kill``: no shutdown at all)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> Self:
        self.stop(kill=True)
        return self.start()

    def pause(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop(kill=True)
        if self._dir_path is not None:
            shutil.rmtree(self._dir_path, ignore_errors=True)
            self._dir_path = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
