"""How much memory this process may use: the machine's, its container's.

A container's memory limit (its cgroup's) is often far below the host's
memory that ``sysconf`` reports, and a CPU tier sized from the host would be
killed by the limit as it fills under load. The slot region also lives in a
shared-memory file system (``/dev/shm``), which containers often keep small.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60
"""cgroup v1 reports "no limit" as a number near 2**63."""


def physical_bytes() -> int:
    """The machine's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max": no limit
        return None
    value = int(text)
    return value if value < NO_LIMIT else None


def _own_cgroup() -> str:
    """This process's cgroup v2 path ("" when unknown or at the root)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip().lstrip("/")
    except OSError:
        pass
    return ""


def cgroup_limit_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit of this process's cgroup (v2, or v1's memory
    controller), None when there is none or it cannot be read."""
    candidates = [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    own = _own_cgroup()
    if own:
        candidates.insert(0, root / own / "memory.max")
    limits = [limit for path in candidates if (limit := _read_limit(path)) is not None]
    return min(limits) if limits else None


def usable_bytes() -> int:
    """The smaller of the machine's memory and this process's cgroup limit."""
    limit = cgroup_limit_bytes()
    total = physical_bytes()
    return total if limit is None else min(total, limit)


def free_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes free for this user in ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize
