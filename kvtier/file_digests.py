"""Content digests of large files, remembered from one start to the next.

The model identity (``kvtier.identity``) hashes every byte of every weights
file: new weights at an old path must change it even when they differ in a
few rows of one tensor. That costs one read of the checkpoint (README, "Model
identity"); a restart on the same files must not pay it again. So each
digest is remembered in one small JSON file under a key made of what a
change of the file's content changes: its device, inode, size, and
modification and status-change times in nanoseconds. Writing a file updates
both times, and no tool sets the status-change time back, so a file whose
key is unchanged has the content it had. A copy of the checkpoint elsewhere
has other keys: it is read once, and gets the same digest. A digest of a file
whose times are less than ``RACY_S`` old is not remembered: on a file system
with coarse timestamps a write later within the same tick would keep the key
(git's "racy" entries).

The cache file is ``$KVTIER_CACHE_DIR/file-digests.json`` (default
``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``). A cache that cannot
be read is ignored; one that cannot be written is skipped (the digests are
computed again at the next start); two processes writing at once lose one's
entries, never corrupt the file (written to a temporary file, then renamed).

Whoever can write the cache decides which weights an engine believes it has
(a forged entry gives new weights an old digest, and the engine serves the
old weights' blocks). So the directory is made 0700 (its missing parents
too, whatever the umask), the file 0600, and a file that is not this user's
regular file, that others may write, or that is larger than a cache of
``MAX_ENTRIES`` can be (``MAX_CACHE_BYTES``) is ignored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from pathlib import Path

import xxhash

from kvtier.atomic_files import make_private_dirs
from kvtier.errors import KVTierError

logger = logging.getLogger(__name__)

CACHE_NAME = "file-digests.json"
"""The cache's file name, in the cache directory."""

MAX_ENTRIES = 4096
"""Digests remembered; the oldest are dropped first."""

MAX_CACHE_BYTES = 1 << 20
"""Largest cache file read: ``MAX_ENTRIES`` entries take about 600 KB."""

READ_BYTES = 16 << 20
"""Bytes read per call while hashing a file."""

_DIGEST_HEX = re.compile(r"[0-9a-f]{32}")
"""A remembered digest: the hex of an XXH3-128."""


class FileChangedError(KVTierError, OSError):
    """A file changed while it was being hashed."""


def default_cache_dir() -> Path | None:
    """``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else
    ``~/.cache/kvtier``; None when there is no home directory to put it in (a
    container user without one: digests are then computed at every start)."""
    explicit = os.environ.get("KVTIER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # neither $HOME nor a passwd entry
            return None
    return Path(base) / "kvtier"


def content_digest(path: Path) -> bytes:
    """XXH3-128 of every byte of ``path``, read in ``READ_BYTES`` chunks."""
    h = xxhash.xxh3_128()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.digest()


RACY_S = 2.0
"""A file changed this recently may change again without changing its key
(coarse timestamps: 1 s on ext3 and HFS+, 2 s on FAT): its digest is not
remembered."""


def _stat_key(path: Path) -> tuple[str, int]:
    """The content key of ``path``, and its newer time (ns since the epoch)."""
    st = os.stat(path)
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    return key, max(st.st_mtime_ns, st.st_ctime_ns)


class FileDigests:
    """The digests of files, by the key of their content (module doc).

    Owns ``entries`` (stat key -> hex digest, oldest first, at most
    ``MAX_ENTRIES``) loaded from ``cache_dir`` (None: nothing is remembered),
    and whether they changed since loading (``save`` writes them then).
    """

    def __init__(self, cache_dir: Path | None) -> None:
        self.path = None if cache_dir is None else Path(cache_dir) / CACHE_NAME
        self.entries: dict[str, str] = self._load()
        self.computed = 0
        self._changed = False

    def _load(self) -> dict[str, str]:
        if self.path is None:
            return {}
        try:
            raw = json.loads(_read_own_file(self.path, MAX_CACHE_BYTES))
        except (OSError, ValueError) as exc:
            if not isinstance(exc, FileNotFoundError):
                logger.info("kvtier: ignoring the file digest cache %s: %s", self.path, exc)
            return {}
        if not isinstance(raw, dict):
            return {}
        # only well-formed digests: another value (an edit, another tool's
        # truncated write) would make the file's digest one its bytes do not have
        return {k: v for k, v in raw.items()
                if isinstance(k, str) and isinstance(v, str) and _DIGEST_HEX.fullmatch(v)}

    def digest(self, path: Path) -> bytes:
        """The content digest of ``path``, remembered or computed.

        Raises ``OSError`` when it cannot be read, ``FileChangedError`` when
        it changes while being read.
        """
        key, changed_ns = _stat_key(path)
        known = self.entries.get(key)
        if known is not None:
            return bytes.fromhex(known)
        digest = content_digest(path)
        if _stat_key(path)[0] != key:
            raise FileChangedError(f"{str(path)!r} changed while kvtier hashed it")
        self.computed += 1
        if time.time_ns() - changed_ns < RACY_S * 1e9:
            return digest  # too fresh to trust its key (module doc)
        self.entries[key] = digest.hex()
        while len(self.entries) > MAX_ENTRIES:
            del self.entries[next(iter(self.entries))]
        self._changed = True
        return digest

    def save(self) -> None:
        """Write the entries if they changed; a failure is logged, not raised."""
        if self.path is None or not self._changed:
            return
        try:
            make_private_dirs(self.path.parent)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests-")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(self.entries, f)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            logger.info("kvtier: cannot write the file digest cache %s: %s", self.path, exc)
            return
        self._changed = False


# O_NONBLOCK: a FIFO at the cache's path would block a plain open until a writer came
_O_READ = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _read_own_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of this process's user
    that neither its group nor others may write, of at most ``limit`` bytes;
    ``ValueError`` saying why not otherwise (``OSError`` when unreadable)."""
    fd = os.open(path, _O_READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"owned by uid {st.st_uid}, not this process's user")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValueError(f"writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than {limit}")
        data = b""
        while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > limit:  # grew since the fstat
        raise ValueError(f"more than {limit} bytes")
    return data
