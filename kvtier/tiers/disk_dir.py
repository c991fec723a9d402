"""A disk tier's directory: its layout, who may use it, and what is in it.

Layout (every directory 0700, every file 0600, owned by the engine's user)::

    <path>/kvtier-v1/<namespace>/namespace.json          the manifest (optional)
    <path>/kvtier-v1/<namespace>/<xx>/<key hex>.kvb      a block (blockfile format)
    <path>/kvtier-v1/<namespace>/<xx>/.<name>.<pid>.<n>.tmp   a write in progress

``xx`` is a byte of the key's xxh3 hash (256 subdirectories, so no directory
grows past a few thousand entries per million blocks). The tier that keeps an
index of these files and their bytes is :mod:`kvtier.tiers.disk`; the admin
tools walk the same layout (:mod:`kvtier.tools.disk_layout`).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import logging
import os
import pwd
import re
import stat
import time
from collections.abc import Mapping
from pathlib import Path

import xxhash

from kvtier.atomic_files import make_private_dirs
from kvtier.file_locks import hold_lock, is_locked
from kvtier.slots.region import pid_alive
from kvtier.tiers.base import TierConfigError

logger = logging.getLogger(__name__)

LAYOUT_DIR = "kvtier-v1"
MANIFEST_NAME = "namespace.json"
"""A namespace's manifest: what the engine that created it said about itself
(model name, KV dtype, rank: for operators; never a salt), written once."""
BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
FAN_OUT = 256
ALLOC_UNIT = 4096
"""Bytes accounted per file are rounded up to this (a file system block)."""
MAX_DISK_KEY_BYTES = 120
"""Longest key the disk tier stores (file names are the key in hex)."""
_TMP_NAME = re.compile(r"\.(\d+)\.\d+\.tmp$")
O_WRITE = (
    os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOFOLLOW", 0)
)
"""Flags of a new temp file: never an existing file, never through a symlink."""

FUTURE_SLACK_S = 1.0
"""A block file's time may be this far ahead of the scan's clock before it
counts as written in the future (a clock set back)."""
Scanned = tuple[float, bytes, int]
"""``(mtime, key, accounted bytes)`` of one block file."""


def allocated(size: int) -> int:
    """Bytes a file of ``size`` bytes is accounted: rounded up to ``ALLOC_UNIT``,
    and at least one unit, so that the index holds at most
    ``capacity // ALLOC_UNIT`` entries also when a crash left empty files."""
    return max(1, -(-size // ALLOC_UNIT)) * ALLOC_UNIT


def fan_out_index(key: bytes) -> int:
    """Index of the subdirectory (named ``f"{index:02x}"``) holding ``key``'s file."""
    return xxhash.xxh3_64_intdigest(key) & (FAN_OUT - 1)


def block_name_key(name: str) -> bytes | None:
    """The key a block file's name stands for; None unless the name is exactly
    the one the tier gives that key (``TierDirectory.file``: lower-case hex,
    ``BLOCK_SUFFIX``). ``bytes.fromhex`` alone also takes upper case and
    spaces: the tier would index such a file under a key whose file is
    another name, and its evictions would never remove it."""
    if not name.endswith(BLOCK_SUFFIX) or name.startswith("."):
        return None
    try:
        key = bytes.fromhex(name[: -len(BLOCK_SUFFIX)])
    except ValueError:
        return None
    if not 1 <= len(key) <= MAX_DISK_KEY_BYTES or f"{key.hex()}{BLOCK_SUFFIX}" != name:
        return None
    return key


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a disk tier temp file's (``.<...>.tmp``, a write in progress)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def stale_temp(name: str, age_s: float, max_age_s: float, me: int | None = None) -> bool:
    """Whether a temp file is left over: older than ``max_age_s``, or written by a
    pid (from its name) other than ``me`` that no longer runs."""
    if age_s > max_age_s:
        return True
    match = _TMP_NAME.search(name)
    if match is None:
        return False
    pid = int(match.group(1))
    return pid != me and not pid_alive(pid)


def write_full(fd: int, buffers: list[memoryview]) -> None:
    """Write every byte of ``buffers`` to ``fd`` (``writev`` may write fewer)."""
    while buffers:
        n = os.writev(fd, buffers)
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]


def unlink_quietly(path: str) -> bool:
    """Remove ``path``; False (logged unless it was gone) when it could not be."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("kvtier disk tier: cannot remove %s: %s", path, exc)
        return False
    return True


def check_tier_path(path: str | os.PathLike[str]) -> None:
    """``TierConfigError`` when a disk tier could not make its directory at
    ``path``: it exists and is no writable directory, the nearest existing
    directory above it is not writable, or a directory on the way belongs to
    another user (``check_owners``). Changes nothing (a check before a server
    starts)."""
    target = Path(path)
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "exists" if probe == target else f"is under {probe}, which exists"
        raise TierConfigError(f"disk_path {target} {where} and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise TierConfigError(f"disk_path {target}: {probe} is not writable by this user")
    check_owners(target)


def check_owners(path: str | os.PathLike[str], _links: int = 0) -> None:
    """``TierConfigError`` when ``path``, a directory above it, or a symlink
    on the way (and the way to its target) belongs to a user other than this
    process's or root, or when one of those directories lets other users
    rename what it holds (``_open_to_others``); missing ones are skipped.
    Such a user could rename the cache's own 0700 directories away and put a
    tree of its files in their place, which this engine would serve: the
    checksum is no signature."""
    allowed = {0, os.geteuid()}
    absolute = Path(os.path.abspath(path))
    for entry in (*reversed(absolute.parents), absolute):
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise TierConfigError(f"disk_path {path}: cannot check {entry}: {exc}") from None
        if st.st_uid not in allowed:
            raise TierConfigError(
                f"disk_path {path}: {entry} belongs to uid {st.st_uid}, neither this "
                f"process's uid {os.geteuid()} nor root; that user could replace the "
                f"cache's directories with its own files, so the disk tier refuses it "
                f"(use a directory of this user's, under directories of this user or root)")
        if stat.S_ISDIR(st.st_mode):
            others = _open_to_others(st)
            if others is not None:
                raise TierConfigError(
                    f"disk_path {path}: {entry} is writable by {others} and has no sticky "
                    f"bit, so they could replace the cache's directories with their own "
                    f"files; the disk tier refuses it (chmod go-w or chmod +t it, or use "
                    f"a disk_path under directories only this user or root may write)")
        elif stat.S_ISLNK(st.st_mode):
            if _links >= _MAX_LINKS:
                raise TierConfigError(f"disk_path {path}: too many symlinks")
            # a relative target starts where the link is, symlinks above resolved
            target = Path(os.path.realpath(entry.parent)) / os.readlink(entry)
            check_owners(target, _links + 1)


def _open_to_others(st: os.stat_result) -> str | None:
    """Who besides this user and root may rename entries of the directory
    ``st`` describes (None: no one). Whoever owns it: a root-owned 0777
    directory (a container's shared volume) is as open as another user's.
    The sticky bit (/tmp, /dev/shm) limits renames to an entry's owner. A
    group counts unless it is this user's private group (same name, no other
    member listed: ``umask 002`` systems make every directory group-writable)."""
    if st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & stat.S_IWOTH:
        return "every user"
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid):
        return f"group {st.st_gid}"
    return None


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's own (user private group)."""
    try:
        group = grp.getgrgid(gid)
        me = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # no name for the group or the user: nothing shows it is private
        return False
    return group.gr_name == me and set(group.gr_mem) <= {me}


_MAX_LINKS = 40
"""Symlinks followed to check a ``disk_path`` (Linux's own limit is 40)."""


class TierDirectory:
    """One namespace's directory tree of a disk tier: ``root`` and its subdirectories.

    Owns paths only (no index, no lock; safe from any thread): creating the
    tree and checking an existing one (``make``: each directory a real one,
    0700, this user's), the manifest (written once), a block's file name,
    and reading every block file (``scan``). Holds ``FAN_OUT`` path strings.
    """

    __slots__ = ("path", "root", "_subdirs", "_device")

    def __init__(self, path: str | os.PathLike[str], namespace: str) -> None:
        self.path = Path(path)
        self.root = self.path / LAYOUT_DIR / namespace
        self._subdirs = [str(self.root / f"{i:02x}") for i in range(FAN_OUT)]
        self._device: int | None = None  # of ``path``, once made

    def make(self) -> None:
        """Create the tree, or check the existing one (``TierConfigError`` when unusable)."""
        try:
            if self.path.exists() and not self.path.is_dir():
                raise TierConfigError(f"disk_path {self.path} exists and is not a directory")
            make_private_dirs(self.path)
            check_owners(self.path)  # after making it: one made meanwhile by another is seen
            for directory in (self.path / LAYOUT_DIR, self.root):
                self._own(directory)
            for sub in self._subdirs:
                self._own(Path(sub))
            if self._device is None:
                self._device = os.stat(self.path).st_dev
        except OSError as exc:
            raise TierConfigError(f"disk_path {self.path}: cannot use it: {exc}") from None

    def remake(self) -> None:
        """Recreate directories removed while serving (errors as ``OSError``),
        only on the file system ``disk_path`` was on: when its disk was
        unmounted, the path leads to another one (often the root disk), which
        the tier's capacity and free-space reserve were not meant for."""
        probe = self.path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if self._device is not None and os.stat(probe).st_dev != self._device:
            raise OSError(errno.ENODEV, f"disk tier: {probe} is no longer on the file system "
                          f"disk_path {self.path} was on (unmounted?): stores dropped")
        try:
            self.make()
        except TierConfigError as exc:
            raise OSError(errno.ENOENT, str(exc)) from None

    @staticmethod
    def _own(directory: Path) -> None:
        """Create ``directory`` 0700, or check an existing one is ours and private."""
        try:
            os.mkdir(directory, 0o700)
            return
        except FileExistsError:
            pass
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise TierConfigError(f"disk tier: {directory} is not a directory")
        if st.st_uid != os.geteuid():
            raise TierConfigError(
                f"disk tier: {directory} belongs to uid {st.st_uid}, not this process's "
                f"uid {os.geteuid()}; engines sharing a cache directory must run as one user"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(directory, 0o700)

    def write_manifest(self, manifest: Mapping[str, object]) -> None:
        """Write the namespace's manifest unless one exists (temp file, rename;
        0600). Best effort: a manifest is for operators, never needed to serve."""
        final = self.root / MANIFEST_NAME
        if final.exists():
            return
        tmp = self.root / f".{MANIFEST_NAME}.{os.getpid()}.0{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, O_WRITE, 0o600)
            try:
                hold_lock(fd)
                write_full(fd, [memoryview(json.dumps(dict(manifest), sort_keys=True,
                                                      default=str).encode())])
                os.replace(tmp, final)
            finally:
                os.close(fd)
        except OSError as exc:
            unlink_quietly(str(tmp))
            logger.warning("kvtier disk tier: cannot write %s: %s", final, exc)

    def subdir(self, key: bytes) -> str:
        """The subdirectory of ``key``'s file (and of its temp files)."""
        return self._subdirs[fan_out_index(key)]

    def file(self, key: bytes) -> str:
        """The path of ``key``'s block file."""
        return f"{self._subdirs[fan_out_index(key)]}/{key.hex()}{BLOCK_SUFFIX}"

    def temp_file(self, key: bytes, serial: int) -> str:
        """A new temp file for ``key``'s block, in its subdirectory: the name
        carries this process's pid, so a scan can tell a dead writer's."""
        return f"{self.subdir(key)}/.{key.hex()[:32]}.{os.getpid()}.{serial}{TMP_SUFFIX}"

    def scan(self, tmp_max_age_s: float) -> tuple[list[Scanned], int, int]:
        """Every block file, oldest first; how many temp files were removed
        on the way (those of dead writers, and any older than ``tmp_max_age_s``);
        and how many ``.kvb`` entries were left out: names other than the one
        the tier gives a block (``block_name_key``, in the key's own
        subdirectory), which it could neither read nor evict (``kvtier disk
        verify --repair`` removes them), and what is not a regular file."""
        found: list[Scanned] = []
        now, me, removed, foreign = time.time(), os.getpid(), 0, 0
        for home, sub in enumerate(self._subdirs):
            try:
                entries = os.scandir(sub)
            except FileNotFoundError:
                self.remake()
                continue
            with entries:
                for entry in entries:
                    name = entry.name
                    if name.endswith(BLOCK_SUFFIX) and name[0] != ".":
                        block = _block_entry(entry, now, home)
                        if block is not None:
                            found.append(block)
                        else:
                            foreign += 1
                    elif is_temp_name(name) and _stale_entry(entry, now, me, tmp_max_age_s):
                        removed += unlink_quietly(entry.path)
        found.sort()
        return found, removed, foreign


def _block_entry(entry: os.DirEntry[str], now: float, home: int) -> Scanned | None:
    """A block file's scan row; None for a name the tier does not give the
    block (``block_name_key``, subdirectory ``home``) or anything but a
    regular file.
    A modification time ahead of ``now`` (written before the clock was set
    back) becomes ``now``, on disk too: else the scan's order, which is the
    tier's LRU order, would keep such a block the most recent until the clock
    caught up, and evict every block used since before it."""
    key = block_name_key(entry.name)
    if key is None or fan_out_index(key) != home:
        return None
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    mtime = st.st_mtime
    if mtime > now + FUTURE_SLACK_S:
        mtime = now
        with contextlib.suppress(OSError):  # then the next scan tries again
            os.utime(entry.path, (now, now), follow_symlinks=False)
    return mtime, key, allocated(st.st_size)


def _stale_entry(entry: os.DirEntry[str], now: float, me: int, max_age_s: float) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):  # never a temp file of ours (a FIFO, a directory)
        return False
    return stale_temp(entry.name, now - st.st_mtime, max_age_s, me) and not is_locked(entry.path)
