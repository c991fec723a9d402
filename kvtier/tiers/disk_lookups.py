"""File-system lookups the scheduler's thread may make, with a deadline.

The disk tier answers ``contains`` from its index, and finds a block another
engine wrote to a shared directory with one ``stat`` per key it does not
know. On a local disk that ``stat`` takes microseconds. On a network file
system whose server went away (a lost NFS mount) it blocks until the server
returns, and with it the engine's scheduler. :class:`DeadlineLookups` runs
those lookups on a thread of its own and waits for them at most a deadline;
while one is overdue, later lookups do not wait at all (their keys are
misses). :func:`lookups_for` picks the mode: on a network or FUSE file system
the thread, elsewhere the caller's thread, where a ``stat`` costs a fraction of a
hand-over to another thread (``benchmarks/bench_disk_lookups.py``: 6-7 against
32-77 µs).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

from kvtier.argtypes import is_positive_seconds

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
    contains it; of several mounts on that point, the last, which is on top: an
    autofs trigger with NFS mounted over it), or None where the mount table
    cannot be read."""
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
        if inside and len(point) >= best:  # the later of two on one point is on top
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
                timeout_s: float) -> DeadlineLookups | None:
    """The lookup runner for ``mode`` (``LOOKUP_MODES``) at ``path``: None means
    inline (the caller's thread)."""
    if mode not in LOOKUP_MODES:
        raise ValueError(f"disk lookups must be one of {list(LOOKUP_MODES)}, got {mode!r}")
    if mode == "inline" or (mode == "auto" and not may_hang(file_system_type(path))):
        return None
    return DeadlineLookups(timeout_s)


class DeadlineLookups:
    """Runs lookups one after another on a daemon thread of its own; each caller
    waits for its own at most ``timeout_s``.

    Owns the thread (started on first use) and ``_queue``, the calls waiting,
    at most ``MAX_QUEUED``, each with the time its caller stops waiting (the
    thread skips those). Callers may be several threads (the scheduler's, and
    the I/O threads checking before a write). While the call running has run
    past ``timeout_s`` (a lookup that hangs), new calls are refused at once:
    a hung file system holds one thread and costs each caller nothing.
    ``timeouts`` counts the calls answered with nothing, late or refused.
    """

    MAX_QUEUED = 64

    def __init__(self, timeout_s: float) -> None:
        if not is_positive_seconds(timeout_s):
            raise ValueError(f"lookup timeout_s must be a finite number of seconds > 0, "
                             f"got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.timeouts = 0
        self._cond = threading.Condition()
        self._queue: deque[_Call] = deque()
        self._running_since: float | None = None  # when the call running started
        self._thread: threading.Thread | None = None
        self._closed = False

    def run(self, call: Callable[[], list[bool]]) -> list[bool] | None:
        """``call()``'s result, or None when it raised, was not answered within
        ``timeout_s``, or was refused (a lookup hangs, or too many wait)."""
        with self._cond:
            now = time.monotonic()
            running = self._running_since
            if ((running is not None and now - running > self.timeout_s)
                    or len(self._queue) >= self.MAX_QUEUED or self._closed):
                self.timeouts += 1
                return None
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="kvtier-disk-lookups")
                self._thread.start()
            item = _Call(call, now + self.timeout_s)
            self._queue.append(item)
            self._cond.notify_all()
            # a close() answers the callers still waiting (with nothing) at once
            self._cond.wait_for(lambda: item.done or self._closed, self.timeout_s)
            if not item.done:
                self.timeouts += 1
                return None
            return item.result

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if self._closed:
                    return
                item = self._queue.popleft()
                late = time.monotonic() > item.deadline  # its caller has given up
                if not late:
                    self._running_since = time.monotonic()
            if not late:
                self._answer(item)
            # not kept while waiting: the call refers to its tier, which the
            # thread must not keep alive (a tier dropped unclosed is collected,
            # and its finalizer closes this runner)
            del item

    def _answer(self, item: _Call) -> None:
        try:
            item.result = item.call()
        except Exception:  # a lookup that fails finds nothing
            item.result = None
        with self._cond:
            item.done = True
            self._running_since = None
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse new lookups and answer the waiting ones with nothing; the thread
        ends once the one running (if any) returns."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()


class _Call:
    """One queued lookup and, once run, its result."""

    __slots__ = ("call", "deadline", "done", "result")

    def __init__(self, call: Callable[[], list[bool]], deadline: float) -> None:
        self.call = call
        self.deadline = deadline
        self.done = False
        self.result: list[bool] | None = None
