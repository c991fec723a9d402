"""Inspect, verify (and repair) and purge a disk tier directory (``kvtier disk ...``).

The directory is walked with :mod:`kvtier.tools.disk_layout`; blocks are checked
with the block file format's own code (:func:`kvtier.tiers.blockfile.decode`:
header, namespace, key, length, xxh3-128 checksum), the namespace and key coming
from the directory and file names, as :class:`~kvtier.tiers.disk.DiskTier` reads
them. Temp files are stale under DiskTier's own rule
(:func:`kvtier.tiers.disk_dir.stale_temp`: the writer's pid is dead, or the file is
older than ``tmp_max_age_s``); a running writer's temp file is never removed.

Engines may keep serving from the directory meanwhile: a block that disappears
during a walk was evicted by one of them and is skipped, and a bad file is only
removed while its path still names the file that was checked.

Memory: one directory entry and one block file at a time; results are passed to
callbacks as they are found, never collected for the whole tier.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.file_locks import is_locked
from kvtier.tiers import blockfile
from kvtier.tiers.blockfile import CorruptBlockError
from kvtier.tiers.disk import TMP_MAX_AGE_S
from kvtier.tiers.disk_dir import block_name_key, fan_out_index, stale_temp
from kvtier.tools import AdminError
from kvtier.tools.disk_layout import (
    Entry,
    FileIdent,
    fan_out_dirs,
    file_ident,
    layout_root,
    manifest_model,
    manifest_path,
    namespace_dirs,
    walk_namespace,
)

AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1m", 60.0), ("<1h", 3_600.0), ("<1d", 86_400.0), ("<1w", 604_800.0), ("older", math.inf),
)
"""Histogram of block ages (time since the file's mtime: its last write or read)."""
MAX_BLOCK_FILE_BYTES = 1 << 30
"""Block files larger than this are reported bad without being read."""
_O_READ = (os.O_RDONLY | os.O_NONBLOCK  # a FIFO put at the path must not block the open
           | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))

Namespaces = Sequence[tuple[str, Path]]
"""``(namespace, directory)`` pairs, from :func:`select`."""


def select(path: str | os.PathLike[str], namespace: str | None = None) -> tuple[Path, Namespaces]:
    """The ``kvtier-v1`` directory under ``path`` and its namespaces (or just
    ``namespace``); :class:`~kvtier.tools.AdminError` for a path that is not a tier
    or an unknown namespace."""
    root = layout_root(path)
    return root, namespace_dirs(root, namespace)


# ---------------------------------------------------------------- inspect
@dataclass
class NamespaceReport:
    """What one namespace directory holds (``namespace="total"`` for the sum)."""

    namespace: str
    model: str | None = None
    blocks: int = 0
    bytes: int = 0
    oldest_mtime: float | None = None
    newest_mtime: float | None = None
    ages: list[int] = field(default_factory=lambda: [0] * len(AGE_BUCKETS))
    temp_files: int = 0
    stale_temp_files: int = 0
    other_files: int = 0

    def add(self, entry: Entry, now: float, tmp_max_age_s: float) -> None:
        """Count one entry of the namespace directory."""
        if entry.kind == "other":
            self.other_files += 1
        elif entry.kind == "temp":
            self.temp_files += 1
            self.stale_temp_files += (stale_temp(entry.name, now - entry.mtime, tmp_max_age_s)
                                      and not is_locked(entry.path))
        else:
            self.blocks += 1
            self.bytes += entry.size
            self._add_mtime(entry.mtime, now)

    def _add_mtime(self, mtime: float, now: float) -> None:
        if self.oldest_mtime is None or mtime < self.oldest_mtime:
            self.oldest_mtime = mtime
        if self.newest_mtime is None or mtime > self.newest_mtime:
            self.newest_mtime = mtime
        age = now - mtime
        self.ages[next(i for i, (_, top) in enumerate(AGE_BUCKETS) if age < top)] += 1

    def merge(self, other: NamespaceReport) -> None:
        """Add ``other``'s counts to these."""
        self.blocks += other.blocks
        self.bytes += other.bytes
        self.temp_files += other.temp_files
        self.stale_temp_files += other.stale_temp_files
        self.other_files += other.other_files
        self.ages = [a + b for a, b in zip(self.ages, other.ages, strict=True)]
        for mtime in (other.oldest_mtime, other.newest_mtime):
            if mtime is not None:
                self.oldest_mtime = mtime if self.oldest_mtime is None else min(
                    self.oldest_mtime, mtime)
                self.newest_mtime = mtime if self.newest_mtime is None else max(
                    self.newest_mtime, mtime)

    def age_s(self, now: float) -> tuple[float | None, float | None]:
        """Ages of the oldest and the newest block, in seconds (None: no blocks)."""
        oldest = None if self.oldest_mtime is None else max(0.0, now - self.oldest_mtime)
        newest = None if self.newest_mtime is None else max(0.0, now - self.newest_mtime)
        return oldest, newest

    def to_dict(self, now: float) -> dict[str, Any]:
        """The counts as JSON-ready values (ages in seconds, rounded to ms)."""
        oldest, newest = self.age_s(now)
        return {
            "namespace": self.namespace,
            "model": self.model,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "oldest_age_s": None if oldest is None else round(oldest, 3),
            "newest_age_s": None if newest is None else round(newest, 3),
            "age_histogram": {name: n for (name, _), n in zip(AGE_BUCKETS, self.ages,
                                                              strict=True)},
            "temp_files": self.temp_files,
            "stale_temp_files": self.stale_temp_files,
            "other_files": self.other_files,
        }


@dataclass
class DiskReport:
    """``kvtier disk inspect``'s result: per namespace and in total, at ``now``."""

    path: str
    root: str
    now: float
    namespaces: list[NamespaceReport]
    total: NamespaceReport

    def to_dict(self) -> dict[str, Any]:
        """The report as one JSON-ready object."""
        total = self.total.to_dict(self.now)
        del total["namespace"], total["model"]
        return {
            "path": self.path,
            "root": self.root,
            "namespaces": [ns.to_dict(self.now) for ns in self.namespaces],
            "total": {"namespaces": len(self.namespaces), **total},
        }


def inspect_disk(path: str | os.PathLike[str], namespace: str | None = None, *,
                 now: float | None = None,
                 tmp_max_age_s: float = TMP_MAX_AGE_S) -> DiskReport:
    """Count the blocks, bytes, ages and temp files of each namespace under ``path``."""
    root, selected = select(path, namespace)
    now = time.time() if now is None else now
    reports = [inspect_namespace(name, ns_dir, now, tmp_max_age_s) for name, ns_dir in selected]
    total = NamespaceReport("total")
    for report in reports:
        total.merge(report)
    return DiskReport(str(path), str(root), now, reports, total)


def inspect_namespace(name: str, ns_dir: Path, now: float,
                      tmp_max_age_s: float = TMP_MAX_AGE_S) -> NamespaceReport:
    """One namespace directory's counts, with its manifest's ``model``."""
    report = NamespaceReport(name, model=manifest_model(ns_dir))
    for entry in walk_namespace(ns_dir):
        report.add(entry, now, tmp_max_age_s)
    return report


# ---------------------------------------------------------------- verify
@dataclass(frozen=True, slots=True)
class BadBlock:
    """A block file that failed a check; ``removed`` by ``--repair``."""

    namespace: str
    path: str
    reason: str
    removed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"namespace": self.namespace, "path": self.path, "reason": self.reason,
                "removed": self.removed}


@dataclass
class VerifySummary:
    """``kvtier disk verify``'s counts; ``bad`` includes those ``removed``."""

    namespaces: int = 0
    blocks: int = 0
    bad: int = 0
    removed: int = 0
    unreadable: int = 0
    """Bad blocks that could not be read (counted in ``bad``): never removed, as
    the engine keeps them: the error may pass (EMFILE, a transient EIO)."""
    vanished: int = 0
    """Files removed by an engine while the walk was on (not bad)."""
    temp_files: int = 0
    stale_temp_files: int = 0
    temp_removed: int = 0
    other_files: int = 0
    repair: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dict(self.__dict__)


def count_blocks(selected: Namespaces) -> int:
    """Block files under the selected namespaces (the progress bar's total)."""
    return sum(
        entry.kind == "block" for _, ns_dir in selected for entry in walk_namespace(ns_dir)
    )


def verify_disk(
    selected: Namespaces,
    *,
    repair: bool = False,
    on_bad: Callable[[BadBlock], None] = lambda bad: None,
    progress: Callable[[int], None] = lambda n: None,
    now: float | None = None,
    tmp_max_age_s: float = TMP_MAX_AGE_S,
) -> VerifySummary:
    """Check every block file of ``selected``; report each bad one to ``on_bad`` and
    each block checked to ``progress``. With ``repair``, remove the bad ones and the
    stale temp files."""
    summary = VerifySummary(namespaces=len(selected), repair=repair)
    now = time.time() if now is None else now
    for name, ns_dir in selected:
        ns = name.encode()
        for entry in walk_namespace(ns_dir):
            if entry.kind == "other":
                summary.other_files += 1
            elif entry.kind == "temp":
                _verify_temp(entry, summary, repair, now, tmp_max_age_s)
            else:
                _verify_block(name, ns, entry, summary, repair, on_bad)
                progress(1)
    return summary


def _verify_block(name: str, ns: bytes, entry: Entry, summary: VerifySummary, repair: bool,
                  on_bad: Callable[[BadBlock], None]) -> None:
    try:
        reason, ident = check_block(entry, ns)
    except FileNotFoundError:
        summary.vanished += 1
        return
    except OSError as exc:  # kept, as the engine keeps it: the error may pass (EMFILE, EIO)
        summary.blocks += 1
        summary.bad += 1
        summary.unreadable += 1
        on_bad(BadBlock(name, entry.path, f"unreadable: {exc.strerror or exc}", False))
        return
    summary.blocks += 1
    if reason is None:
        return
    removed = repair and remove_if_same(entry.path, ident)
    summary.bad += 1
    summary.removed += removed
    on_bad(BadBlock(name, entry.path, reason, removed))


def _verify_temp(entry: Entry, summary: VerifySummary, repair: bool, now: float,
                 tmp_max_age_s: float) -> None:
    summary.temp_files += 1
    if not stale_temp(entry.name, now - entry.mtime, tmp_max_age_s) or is_locked(entry.path):
        return
    summary.stale_temp_files += 1
    if repair and remove_if_same(entry.path, entry.ident):
        summary.temp_removed += 1


def check_block(entry: Entry, namespace: bytes) -> tuple[str | None, FileIdent]:
    """``(reason, file ident)`` for one block file; reason None: it holds.

    Raises ``FileNotFoundError`` when the file is gone (evicted meanwhile), and
    ``OSError`` when it cannot be read (nothing is known of its bytes then).
    """
    key = block_key_of(entry.name)
    if key is None:
        return "file name is not a block key", entry.ident
    home = f"{fan_out_index(key):02x}"
    if entry.fan_out != home:
        return f"in fan-out directory {entry.fan_out}, belongs in {home}", entry.ident
    try:
        value, ident = read_block_file(entry.path)
    except CorruptBlockError as exc:
        return _reason(exc), entry.ident
    try:
        blockfile.decode(value, namespace, key)
    except CorruptBlockError as exc:
        return _reason(exc), ident
    return None, ident


def block_key_of(name: str) -> bytes | None:
    """The key a block file's name stands for (None: not a name the disk tier
    gives a block, which it neither reads nor evicts: ``block_name_key``)."""
    return block_name_key(name)


def read_block_file(path: str) -> tuple[memoryview, FileIdent]:
    """The whole file (symlinks not followed) and its ``FileIdent``.

    Raises :class:`CorruptBlockError` for a file that is not a regular one or is
    larger than :data:`MAX_BLOCK_FILE_BYTES`, ``OSError`` when unreadable.
    """
    try:
        fd = os.open(path, _O_READ)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise CorruptBlockError("not a regular file", "a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptBlockError("not a regular file")
        if st.st_size > MAX_BLOCK_FILE_BYTES:
            raise CorruptBlockError("oversized", f"{st.st_size} bytes, not read")
        buf = memoryview(bytearray(st.st_size))
        got = 0
        while got < st.st_size:
            n = os.readv(fd, [buf[got:]])
            if n == 0:
                break
            got += n
        return buf[:got], file_ident(st)
    finally:
        os.close(fd)


def _reason(exc: CorruptBlockError) -> str:
    """``"checksum mismatch"``, ``"truncated (100 bytes, header needs 40)"``..."""
    text = str(exc)
    prefix = "corrupt kvtier block: "
    return text[len(prefix):] if text.startswith(prefix) else exc.reason


def remove_if_same(path: str, ident: FileIdent) -> bool:
    """Unlink ``path`` if it still names the file ``ident`` was taken from (an
    engine may have replaced it by a good copy meanwhile); True when removed."""
    try:
        st = os.lstat(path)
        if file_ident(st) != ident:
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------- purge
@dataclass
class PurgeSummary:
    """What ``kvtier disk purge`` removed, and what it left alone."""

    namespaces: int = 0
    blocks: int = 0
    bytes: int = 0
    temp_files: int = 0
    temp_in_use: int = 0
    """Temp files of running writers (locked until their rename): left alone."""
    manifests: int = 0
    dirs_removed: int = 0
    namespace_dirs_removed: int = 0
    other_files: int = 0
    """Entries that are not kvtier's: left where they are."""
    failed: int = 0
    first_error: str | None = None
    stopped: str | None = None
    """Why the purge stopped part way (a directory it could not read), or None;
    the counts above are what it removed before."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dict(self.__dict__)


def purge_disk(selected: Namespaces, summary: PurgeSummary | None = None) -> PurgeSummary:
    """Remove kvtier's files of ``selected``: block files, temp files (but those
    of running writers), manifests, then the fan-out and namespace directories
    that are empty. Nothing else. A directory it cannot read stops it
    (``stopped``), with what it removed until then counted. The counts go to
    ``summary`` as files go, so that a caller interrupted meanwhile (Ctrl-C)
    can still tell what was removed."""
    if summary is None:
        summary = PurgeSummary()
    summary.namespaces = len(selected)
    for _, ns_dir in selected:
        try:
            _purge_namespace(ns_dir, summary)
        except AdminError as exc:
            summary.stopped = str(exc)
            break
    return summary


def _purge_namespace(ns_dir: Path, summary: PurgeSummary) -> None:
    for entry in walk_namespace(ns_dir):
        if entry.kind == "other":
            summary.other_files += 1
        elif entry.kind == "temp" and is_locked(entry.path):
            summary.temp_in_use += 1  # a running writer's: its rename would fail
        elif _unlink(entry.path, summary):
            if entry.kind == "block":
                summary.blocks += 1
                summary.bytes += entry.size
            else:
                summary.temp_files += 1
    for sub in list(fan_out_dirs(ns_dir)):
        summary.dirs_removed += _rmdir(sub)
    manifest = manifest_path(ns_dir)
    try:
        is_manifest = stat.S_ISREG(os.lstat(manifest).st_mode)
    except OSError:
        is_manifest = False
    if is_manifest and _unlink(str(manifest), summary):
        summary.manifests += 1
    summary.namespace_dirs_removed += _rmdir(ns_dir)


def _unlink(path: str, summary: PurgeSummary) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        summary.failed += 1
        summary.first_error = summary.first_error or f"{path}: {exc.strerror or exc}"
        return False
    return True


def _rmdir(directory: Path) -> bool:
    """Remove ``directory`` if it is empty (it keeps what is not kvtier's)."""
    try:
        os.rmdir(directory)
    except OSError:
        return False
    return True
