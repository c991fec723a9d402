"""Walking a disk tier directory: which entries are kvtier's, which are not.

The layout is :mod:`kvtier.tiers.disk_dir`'s::

    PATH/kvtier-v1/<namespace>/namespace.json           the namespace's manifest (optional)
    PATH/kvtier-v1/<namespace>/<xx>/<key hex>.kvb       a block
    PATH/kvtier-v1/<namespace>/<xx>/.<name>.<pid>.<n>.tmp   a write in progress

Only real directories are walked (a symlink is never followed), and only
regular files are kvtier's: anything else found in the tree is reported as
``other`` so that the tools can leave it alone. Walks are generators over
``os.scandir``: memory does not grow with the number of blocks.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtier.tiers.disk_dir import BLOCK_SUFFIX, LAYOUT_DIR, MANIFEST_NAME, is_temp_name
from kvtier.tiers.namespace import check_namespace
from kvtier.tools import AdminError
from kvtier.tools.formatting import printable

MAX_MANIFEST_BYTES = 64 * 1024
"""Larger manifests are not read (a manifest is a few hundred bytes)."""
_FAN_OUT_NAME = re.compile(r"[0-9a-f]{2}")

EntryKind = Literal["block", "temp", "other"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a namespace directory; ``fan_out`` is its subdirectory's name
    (empty for entries directly in the namespace directory)."""

    kind: EntryKind
    path: str
    name: str
    fan_out: str
    size: int
    mtime: float
    ident: FileIdent
    """Tells whether the path still names this file (``file_ident``)."""


FileIdent = tuple[int, int, int, int]
"""``(st_dev, st_ino, st_mtime_ns, st_ctime_ns)`` of a file: an inode number
freed by one file and reused by the next has other times."""


def file_ident(st: os.stat_result) -> FileIdent:
    """The ``FileIdent`` of a ``stat`` result."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def layout_root(path: str | os.PathLike[str]) -> Path:
    """``PATH/kvtier-v1`` of a disk tier directory; :class:`AdminError` when ``path``
    does not exist or is not a kvtier disk tier."""
    base = Path(path)
    try:
        st = os.stat(base)
    except FileNotFoundError:
        raise AdminError(f"{base}: no such directory") from None
    except OSError as exc:
        raise AdminError(f"{base}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise AdminError(f"{base} is not a directory (expected a disk tier's disk_path)")
    root = base / LAYOUT_DIR
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise AdminError(
            f"{base} is not a kvtier disk tier: it has no {LAYOUT_DIR} directory"
        ) from None
    except OSError as exc:
        raise AdminError(f"{root}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise AdminError(
            f"{base} is not a kvtier disk tier: {root} is not a directory"
            + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
        )
    return root


def namespace_dirs(root: Path, namespace: str | None = None) -> list[tuple[str, Path]]:
    """``(namespace, directory)`` of the tier's namespaces, sorted by name; only
    ``namespace`` when given (:class:`AdminError` when it is not there)."""
    if namespace is not None:
        try:
            check_namespace(namespace)
        except ValueError as exc:
            raise AdminError(f"bad --namespace: {exc}") from None
    found: list[tuple[str, Path]] = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if _is_namespace_dir(entry) and namespace in (None, entry.name):
                    found.append((entry.name, Path(entry.path)))
    except OSError as exc:
        raise AdminError(f"{root}: cannot read it: {exc.strerror or exc}") from None
    if namespace is not None and not found:
        known = [name for name, _ in namespace_dirs(root)]
        listed = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "")
        raise AdminError(
            f"unknown namespace {namespace!r} in {root} "
            f"({'namespaces: ' + listed if known else 'it holds no namespaces'})"
        )
    return sorted(found)


def _is_namespace_dir(entry: os.DirEntry[str]) -> bool:
    try:
        check_namespace(entry.name)
    except ValueError:
        return False
    return entry.is_dir(follow_symlinks=False)


def walk_namespace(ns_dir: Path) -> Iterator[Entry]:
    """Every entry of a namespace directory and its fan-out subdirectories, except
    the manifest; the fan-out directories themselves are not yielded."""
    for entry in _scandir(ns_dir):
        if entry.name == MANIFEST_NAME and entry.is_file(follow_symlinks=False):
            continue
        if _FAN_OUT_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            yield from _walk_fan_out(entry.path, entry.name)
        else:
            made = _entry(entry, "")  # not in a fan-out directory: "other"
            if made is not None:
                yield made


def fan_out_dirs(ns_dir: Path) -> Iterator[Path]:
    """The fan-out subdirectories (``00``..``ff``) of a namespace directory."""
    for entry in _scandir(ns_dir):
        if _FAN_OUT_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            yield Path(entry.path)


def _walk_fan_out(directory: str, fan_out: str) -> Iterator[Entry]:
    for entry in _scandir(directory):
        made = _entry(entry, fan_out)
        if made is not None:
            yield made


def _scandir(directory: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
    """The entries of ``directory``; none when it is gone (removed meanwhile, or
    no longer a directory). :class:`AdminError` when it cannot be read (EIO,
    EACCES): a walk that skipped it would report a partial tier as whole."""
    try:
        with os.scandir(directory) as entries:
            yield from entries
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise AdminError(f"{printable(os.fsdecode(directory), 4096)}: cannot read it: "
                         f"{exc.strerror or exc}") from None


def _entry(entry: os.DirEntry[str], fan_out: str) -> Entry | None:
    """Classify one directory entry (None: it vanished meanwhile)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError:
        return Entry("other", entry.path, entry.name, fan_out, 0, 0.0, (0, 0, 0, 0))
    kind: EntryKind = "other"
    if stat.S_ISREG(st.st_mode):
        if fan_out and entry.name.endswith(BLOCK_SUFFIX):
            kind = "block"
        elif is_temp_name(entry.name):  # a block's, or the manifest's (no fan-out)
            kind = "temp"
    return Entry(kind, entry.path, entry.name, fan_out, st.st_size, st.st_mtime, file_ident(st))


def manifest_path(ns_dir: Path) -> Path:
    """Where a namespace's manifest is (it may not exist)."""
    return ns_dir / MANIFEST_NAME


def manifest_model(ns_dir: Path) -> str | None:
    """The ``model`` of a namespace's manifest, made printable; None when there is
    no manifest, it is not a small JSON object or has no string ``model``."""
    path = manifest_path(ns_dir)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_MANIFEST_BYTES:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return printable(model) if isinstance(model, str) and model else None
