"""Advisory ``flock`` marks that say a live process owns a file.

A process id cannot tell a live owner from a dead one across pid namespaces
(containers sharing ``/dev/shm`` or a disk tier's directory): the owner's pid
may be invisible, or name another process. An exclusive ``flock`` held on the
file for as long as the owner needs it can: the kernel drops it when the
owner's last descriptor closes, however the owner ends. Best effort: a file
system without locks (some NFS setups) leaves the pid and age rules alone to
decide.
"""

from __future__ import annotations

import contextlib
import fcntl
import os


def hold_lock(fd: int) -> None:
    """Take an exclusive ``flock`` on ``fd``, held until it is closed. Blocking:
    another process's probe (``is_locked``) holds it an instant."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX)


def is_locked(path: str | os.PathLike[str]) -> bool:
    """Whether a live process holds ``path``'s lock (``hold_lock``) now."""
    try:
        # O_NONBLOCK: a FIFO at ``path`` would block a plain open until a writer came
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False
