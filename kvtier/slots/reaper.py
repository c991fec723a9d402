"""Remove a slot region's file even when its creator is killed.

vLLM stops its workers with SIGKILL when a server shuts down (its default
shutdown mode is "abort", no timeout), and kills every descendant of them
too, so a worker never gets to unlink its slot region: the file, as large as
``cpu_bytes_to_use``, would stay in ``/dev/shm`` (in RAM) until the next
engine's start removed it as stale.

A ``RegionReaper`` is a tiny ``sh`` process, detached from the creator's
process tree (its parent shell exits at once, so it belongs to init), that
holds the read end of a pipe whose write end only the creator holds.
However the creator ends (exit, exception, SIGKILL), the kernel closes its
end, the reaper's ``read`` returns and it removes the file, if the file at
that path is still the one it was started for (same device and inode: a
region created again under the same name, by a restarted worker, is not
the reaper's). It ignores SIGINT, SIGTERM and SIGHUP, so a Ctrl-C sent to
the whole process group does not stop it before its work. A region closed
normally unlinks itself, then writes a line to the pipe before closing it:
the reaper reads the line and removes nothing (the name may already belong
to the next region). Only a SIGKILL of the reaper itself (e.g. of the whole
process group) leaves the file, which the next region creation removes as
stale.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

_SCRIPT = ('trap "" INT TERM HUP; exec 3<&0; '
           '( trap "" INT TERM HUP; read -r closed <&3; [ -z "$closed" ] && '
           '[ "$(stat -c %d:%i -- "$1" 2>/dev/null)" = "$2" ] && rm -f -- "$1" ) '
           '</dev/null >/dev/null 2>&1 & echo $!; exit 0')
"""With the pipe as stdin: start the reaper in the background (reading the
pipe as fd 3), print its pid and exit, so that init adopts the reaper. The
reaper removes ``$1`` only at end of file with no line read (the creator
ended without closing the region) and while ``$1`` is still the file of
device and inode ``$2``."""


REAPER_NAME = "kvtier-region-reaper"
"""The reaper's ``$0``: its command line names it (``is_reaper``)."""


def is_reaper(pid: int) -> bool:
    """Whether process ``pid`` is a region reaper (False when unknown)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return REAPER_NAME.encode() in f.read().split(b"\0")
    except OSError:
        return False


def _reaper_env() -> dict[str, str]:
    """The reaper's whole environment: it outlives the engine, and the engine's
    environment may hold secrets (the Redis password, the tenant salt), which
    ``/proc/PID/environ`` would keep showing."""
    return {"PATH": os.environ.get("PATH") or "/usr/bin:/bin", "LC_ALL": "C"}

_CLOSED = b"closed\n"
"""What a normal close writes to the pipe: the reaper then removes nothing."""


class RegionReaper:
    """Owns the write end of the pipe a detached reaper of ``path`` waits on;
    ``pid`` is the reaper's."""

    def __init__(self, path: Path) -> None:
        self.path = path
        st = os.stat(path)
        identity = f"{st.st_dev}:{st.st_ino}"
        read_end, write_end = os.pipe()
        try:
            starter = subprocess.run(
                ["sh", "-c", _SCRIPT, REAPER_NAME, str(path), identity],
                stdin=read_end, capture_output=True, timeout=10, check=True,
                env=_reaper_env())
            self.pid = int(starter.stdout.split()[0])
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._write_end: int | None = write_end

    def close(self) -> None:
        """Let the reaper finish now, removing nothing (the region unlinked
        itself, and a new region may hold the name already)."""
        fd, self._write_end = self._write_end, None
        if fd is not None:
            with contextlib.suppress(OSError):  # a reaper already gone: EPIPE
                os.write(fd, _CLOSED)
            with contextlib.suppress(OSError):
                os.close(fd)
