"""File-system lookups the scheduler's thread may make, with a deadline.

The disk tier answers ``contains`` from its index, and finds a block another
engine wrote to a shared directory with one ``stat`` per key it does not
know. On a local disk that ``stat`` takes microseconds. On a network file
system whose server went away (a lost NFS mount) it blocks until the server
returns, and with it the engine's scheduler. :class:`DeadlineLookups` runs
those lookups on a thread of its own and waits for them at most a deadline;
while one is overdue, later lookups do not wait at all (their keys are
misses). :func:`lookups_for` picks the mode: on a network or FUSE file system
the thread, elsewhere the caller's thread, whose ``stat`` costs a fifth of a
hand-over to another thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from kvtier.argtypes import is_positive_seconds

T = TypeVar("T")

LOOKUP_MODES = ("auto", "inline", "thread")
"""``auto``: ``thread`` on a network or FUSE file system, else ``inline``."""
DEFAULT_LOOKUP_TIMEOUT_S = 0.1
"""A healthy network file system answers a ``stat`` in milliseconds."""
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs",
    "beegfs", "9p", "afs", "ocfs2", "gfs2", "virtiofs", "davfs", "orangefs", "pvfs2",
})
"""File systems (``/proc/self/mountinfo`` type) whose calls can block on a
server; every ``fuse`` and ``fuse.*`` type counts too."""
MOUNTINFO = "/proc/self/mountinfo"


def file_system_type(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> str | None:
    """The type of the file system ``path`` is on (the longest mount point that
    contains it), or None where the mount table cannot be read."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, best_type = -1, None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, best_type = len(point), right.split()[0]
    return best_type


def _unescape(field: str) -> str:
    """A mountinfo path: spaces and the like are written as octal escapes."""
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="replace")


def may_hang(fs_type: str | None) -> bool:
    """Whether a file system of this type can block its callers on a server."""
    if fs_type is None:
        return False
    return fs_type in NETWORK_FS_TYPES or fs_type == "fuse" or fs_type.startswith("fuse.")


def lookups_for(mode: str, path: str | os.PathLike[str],
                timeout_s: float) -> DeadlineLookups[list[bool]] | None:
    """The lookup runner for ``mode`` (``LOOKUP_MODES``) at ``path``: None means
    inline (the caller's thread)."""
    if mode not in LOOKUP_MODES:
        raise ValueError(f"disk lookups must be one of {list(LOOKUP_MODES)}, got {mode!r}")
    if mode == "inline" or (mode == "auto" and not may_hang(file_system_type(path))):
        return None
    return DeadlineLookups(timeout_s)


class DeadlineLookups(Generic[T]):
    """Runs one lookup at a time on its own daemon thread; the caller waits at
    most ``timeout_s``.

    Owns the thread (started on first use) and the one call in flight (at most
    one: a caller that finds a call still running after its deadline gets no
    answer at once instead of queueing another, so a lookup that hangs holds
    one thread, no more). ``timeouts`` counts the calls answered with nothing,
    overdue or refused.
    """

    def __init__(self, timeout_s: float) -> None:
        if not is_positive_seconds(timeout_s):
            raise ValueError(f"lookup timeout_s must be a finite number of seconds > 0, "
                             f"got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.timeouts = 0
        self._cond = threading.Condition()
        self._call: Callable[[], T] | None = None
        self._answer: list[T | None] = []  # the call in flight's, empty until it returns
        self._busy = False  # a call is queued or running
        self._thread: threading.Thread | None = None

    def run(self, call: Callable[[], T]) -> T | None:
        """``call()``'s result, or None when it raised, did not return within
        the deadline, or a previous call is still running."""
        with self._cond:
            if self._busy:
                self.timeouts += 1
                return None
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="kvtier-disk-lookups")
                self._thread.start()
            answer: list[T | None] = []
            self._call, self._answer, self._busy = call, answer, True
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: bool(answer), self.timeout_s):
                self.timeouts += 1
                return None
            return answer[0]

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._call is not None)
                call, answer, self._call = self._call, self._answer, None
            result: T | None = None
            if call is not None:
                try:
                    result = call()
                except Exception:  # a lookup that fails finds nothing
                    result = None
            with self._cond:
                answer.append(result)
                self._busy = False
                self._cond.notify_all()
