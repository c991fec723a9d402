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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import xxhash

from kvtier.errors import KVTierError

logger = logging.getLogger(__name__)

CACHE_NAME = "file-digests.json"
"""The cache's file name, in the cache directory."""

MAX_ENTRIES = 4096
"""Digests remembered; the oldest are dropped first."""

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
            raw = json.loads(self.path.read_text())
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
            self.path.parent.mkdir(parents=True, exist_ok=True)
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
