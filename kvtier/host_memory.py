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


PROC_SELF_CGROUP = Path("/proc/self/cgroup")
"""Where the kernel lists this process's cgroups, one hierarchy a line."""


def _own_cgroups() -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its cgroup v1 memory controller's
    path, relative to their hierarchy's root ("" at the root, None when the
    process is in no such hierarchy or it cannot be read)."""
    v2: str | None = None
    v1: str | None = None
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            v2 = path.strip().strip("/")
        elif "memory" in controllers.split(","):
            v1 = path.strip().strip("/")
    return v2, v1


def _with_ancestors(base: Path, own: str | None, name: str) -> list[Path]:
    """``name`` in the hierarchy's root at ``base`` and in every cgroup from
    there down to ``own``: a limit on any ancestor binds its descendants."""
    paths = [base / name]
    parts = own.split("/") if own else []
    if ".." in parts:  # outside this cgroup namespace's root: its paths are not ours
        return paths
    node = base
    for part in parts:
        node = node / part
        paths.append(node / name)
    return paths


def cgroup_limit_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit that binds this process: the lowest of its cgroup's
    and its ancestors' (cgroup v2, or v1's memory controller), None when
    there is none or none can be read.

    The hierarchy's root as mounted here comes first: a container's mount
    often shows its own cgroup there, under a path that names the host's."""
    v2, v1 = _own_cgroups()
    candidates = _with_ancestors(root, v2, "memory.max")
    candidates += _with_ancestors(root / "memory", v1, "memory.limit_in_bytes")
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


def check_fits(flag: str, count: int, bytes_each: int, what: str) -> None:
    """``ValueError`` naming ``flag`` when ``count`` items of at least
    ``bytes_each`` bytes take more than this process may use (``usable_bytes``):
    a command refuses such a size before it starts (a number past 2**63
    would end in an ``OverflowError``, a large one in the OOM killer)."""
    limit = usable_bytes()
    if count * bytes_each > limit:
        raise ValueError(f"{flag} {count}: {count:,} {what} take at least "
                         f"{count * bytes_each / 2**30:,.1f} GiB, more than the "
                         f"{limit / 2**30:,.1f} GiB this process may use")
