"""The disk tier: one checksummed file per block under a local directory.

The directory's layout, its creation and its scan are
:mod:`kvtier.tiers.disk_dir`'s. A block is written to a
temp file in the same directory, then renamed over its final name, so a reader
sees either no file or a whole one; every read checks the header and checksum,
and a bad file is a miss, removed, counted (``corrupt``) and reported (event).

Capacity: ``capacity_bytes`` bounds the bytes of block files (each rounded up to
4 KiB, a file system block); the least recently used blocks are evicted to make
room. Independently, a store never lets the file system's free space drop
below ``free_reserve_bytes``: it evicts this tier's own blocks to stay above it,
and otherwise drops the store; ENOSPC/EDQUOT while writing is a dropped store.
Stores reserve their room one at a time, each counting the writes in flight,
so writer threads keep the reserve together; engines sharing a file system
each keep it for their own writes (two writing at one moment may each take the
last room).

Warm restart: a new process scans the directory (names give the keys; one
``stat`` per file for size and mtime; about 1 s per 100k files on a warm
cache) and serves what it finds. Temp files of dead writers, or older than
``tmp_max_age_s``, are removed; others are ignored.

Sharing: several engines (processes) of the same user may use one directory.
Files are only ever created by rename and removed by unlink, so readers never
see partial data; a block one engine removed is a miss for the other.
``contains`` finds blocks written by others (one ``stat`` per key not in this
process's index; on a network or FUSE file system on a thread of its own, waited
for at most ``lookup_timeout_s``, so a lost mount cannot stall the scheduler:
:mod:`kvtier.tiers.disk_lookups`), reads refresh a file's mtime (shared recency), and every
``rescan_interval_s`` a store rescans the directory, so the bytes of all
engines together stay within ``capacity_bytes`` plus what the others wrote
since the last rescan, and within ``capacity_bytes`` times the engines (each
file is in its writer's index until removed, and each index is bounded);
each engine keeps the free-space reserve (above).

Memory: the index holds at most ``capacity_bytes // 4096`` entries (about 200
bytes each): e.g. 100k entries (20 MB) for 200 GB of 2 MiB blocks. Writes in
flight (``_pending``) are at most the threads writing; a rescan's change sets
only live during the rescan (the changes made meanwhile); events at most
``max_events``. ``debug_state()`` reports each.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from kvtier.file_locks import hold_lock
from kvtier.tiers import blockfile
from kvtier.tiers.base import (
    DEFAULT_MAX_TIER_EVENTS,
    Counters,
    Tier,
    TierConfigError,
    TierEvent,
    TierEventLog,
    WarningLimiter,
    check_batch,
    check_buffers,
    check_items,
    seconds_setting,
)
from kvtier.tiers.blockfile import BytesLike, CorruptBlockError
from kvtier.tiers.disk_dir import (
    ALLOC_UNIT,
    MAX_DISK_KEY_BYTES,
    O_WRITE,
    Scanned,
    TierDirectory,
    allocated,
    unlink_quietly,
    write_full,
)
from kvtier.tiers.disk_lookups import DEFAULT_LOOKUP_TIMEOUT_S, DeadlineLookups, lookups_for
from kvtier.tiers.namespace import check_namespace

logger = logging.getLogger(__name__)

DEFAULT_RESERVE_FRACTION = 0.05
DEFAULT_RESERVE_CAP = 1 << 30
TMP_MAX_AGE_S = 600.0
"""Default age after which a temp file is stale even if its writer's pid seems alive."""
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# O_NONBLOCK: something other than a block file at a block's path (a FIFO)
# would block a plain open until a writer came; on a regular file it changes nothing
_O_READ = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
           | getattr(os, "O_NOFOLLOW", 0))


def statvfs_free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _pread_full(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Fill ``buffers`` from ``offset`` (until EOF); returns the bytes read."""
    total = 0
    while buffers:
        n = os.preadv(fd, buffers, offset + total)
        if n == 0:
            break
        total += n
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]
    return total


class DiskTier(Tier):
    """Blocks as checksummed files under ``path`` (see the module docstring).

    Parameters:
        path: directory of the cache (created 0700 if missing).
        namespace: from ``KVLayout(...).namespace(tenant_salt)``.
        capacity_bytes: bytes of block files this tier may keep (``disk_bytes``).
        max_block_bytes: largest payload accepted (``put`` raises ``ValueError``
            beyond it); None: any that fits in ``capacity_bytes``.
        free_reserve_bytes: free space always left on the file system; None:
            5 % of its size, at most 1 GiB.
        fsync: fsync each file before renaming it (durable across power loss;
            without it a crash of the OS may leave a bad file, caught by the checksum).
        rescan_interval_s: rescan the directory this often during stores (picks
            up other engines' blocks and removals); None: only at start.
        tmp_max_age_s: temp files older than this are removed even if their
            writer's pid seems alive (pid namespaces, reused pids).
        touch_on_hit: refresh a file's mtime on each hit (shared recency).
        free_space: ``f(directory) -> free bytes``; default ``statvfs``. For
            quota-managed storage, and tests (a fake-full check).
        manifest: JSON-ready facts for ``MANIFEST_NAME`` (``kvtier disk
            inspect`` shows its ``model``); written when the namespace has none.
        lookups: where ``contains`` looks for blocks other engines wrote
            (``kvtier.tiers.disk_lookups``): ``"thread"``, waiting at most
            ``lookup_timeout_s`` (a hung network file system costs that once,
            then misses until it answers); ``"inline"``, on the caller's thread;
            ``"auto"``: ``"thread"`` on a network or FUSE file system.
    """

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        namespace: str,
        capacity_bytes: int,
        *,
        max_block_bytes: int | None = None,
        free_reserve_bytes: int | None = None,
        fsync: bool = False,
        rescan_interval_s: float | None = 30.0,
        tmp_max_age_s: float = TMP_MAX_AGE_S,
        touch_on_hit: bool = True,
        enable_events: bool = False,
        max_events: int = DEFAULT_MAX_TIER_EVENTS,
        free_space: Callable[[str], int] | None = None,
        manifest: Mapping[str, object] | None = None,
        lookups: str = "auto",
        lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
    ) -> None:
        try:
            self.namespace = check_namespace(namespace)
        except (TypeError, ValueError) as exc:
            raise TierConfigError(f"disk tier: {exc}") from None
        self._ns = self.namespace.encode()
        self.capacity_bytes = _int_setting("capacity_bytes (disk_bytes)", capacity_bytes,
                                           ALLOC_UNIT)
        self.max_block_bytes = (
            None if max_block_bytes is None
            else _int_setting("max_block_bytes", max_block_bytes, 1)
        )
        if self.max_block_bytes is not None:
            largest = allocated(blockfile.header_size(self._ns, b"\0" * MAX_DISK_KEY_BYTES)
                                + self.max_block_bytes)
            if self.capacity_bytes < largest:
                raise TierConfigError(
                    f"disk tier: capacity_bytes (disk_bytes, per rank) {self.capacity_bytes} "
                    f"holds no block: one takes up to {largest} bytes on disk")
        if rescan_interval_s is not None:
            seconds_setting("disk tier", "rescan_interval_s", rescan_interval_s)
        seconds_setting("disk tier", "tmp_max_age_s", tmp_max_age_s)
        seconds_setting("disk tier", "lookup_timeout_s", lookup_timeout_s)  # in any mode
        self.fsync = bool(fsync)
        self.rescan_interval_s = rescan_interval_s
        self.tmp_max_age_s = float(tmp_max_age_s)
        self.touch_on_hit = bool(touch_on_hit)
        self._free_space = free_space or statvfs_free_bytes
        self._warn = WarningLimiter(logger)

        self.dir = TierDirectory(path, self.namespace)
        self.path, self.root = self.dir.path, self.dir.root
        self.dir.make()
        try:
            self._lookups: DeadlineLookups | None = lookups_for(
                lookups, self.root, lookup_timeout_s)
        except ValueError as exc:
            raise TierConfigError(f"disk tier: {exc}") from None
        if self._lookups is not None:
            # its thread holds the runner, not the tier: a tier dropped without
            # close() would leave the thread waiting for ever
            weakref.finalize(self, self._lookups.close)
        if manifest is not None:
            self.dir.write_manifest(manifest)
        if free_reserve_bytes is None:
            st = os.statvfs(self.root)
            free_reserve_bytes = min(
                DEFAULT_RESERVE_CAP, int(st.f_blocks * st.f_frsize * DEFAULT_RESERVE_FRACTION)
            )
        self.free_reserve_bytes = _int_setting("free_reserve_bytes", free_reserve_bytes, 0)

        self._init_index(enable_events, max_events)
        self._rebuild_index()

    def _init_index(self, enable_events: bool, max_events: int) -> None:
        """The in-memory state: the index (rebuilt from the files), pending
        writes, a rescan's changes, counters and events."""
        self._lock = threading.Lock()
        # Held by a store from its free-space reading to its reservation (_reserve);
        # taken before ``_lock``, never inside it.
        self._reserve_lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> accounted bytes, LRU first
        self._indexed_bytes = 0
        self._pending: dict[bytes, int] = {}  # keys being written -> reserved bytes
        self._pending_bytes = 0
        self._scanning = False
        self._scan_added: dict[bytes, None] = {}
        self._scan_removed: set[bytes] = set()
        # Temp names carry the pid and this serial; engines in other pid
        # namespaces may have this pid, so each process starts at a random serial.
        self._tmp_serial = itertools.count(secrets.randbits(40))
        self._closed = False
        self._counters = Counters("duplicates", "no_space", "discovered", "tmp_removed")
        self._events = TierEventLog(self.name, enable_events, max_events)

    def _rebuild_index(self) -> None:
        """Index the block files already on disk (a restart keeps its blocks)."""
        started = time.monotonic()
        self._last_scan = started
        try:
            found = self._scan()
        except OSError as exc:
            raise TierConfigError(f"disk_path {self.path}: cannot read it: {exc}") from None
        blocks = self._load_scan(found)
        self.rebuild_s = time.monotonic() - started
        logger.info(
            "kvtier disk tier %s: %d blocks (%d bytes) found in %.3f s",
            self.root, blocks, self._indexed_bytes, self.rebuild_s,
        )

    def _check_key(self, key: bytes) -> None:
        # checked before ``put`` reserves anything: the block file's header
        # refuses an empty key only once the write has begun
        if not 1 <= len(key) <= MAX_DISK_KEY_BYTES:
            raise ValueError(
                f"disk tier keys are at least 1 and at most {MAX_DISK_KEY_BYTES} bytes, "
                f"got {len(key)}"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"disk tier {self.root} is closed")

    # ------------------------------------------------------------------ scan
    def _scan(self) -> list[Scanned]:
        """Every block file, oldest first; stale temp files are removed and counted."""
        found, removed, foreign = self.dir.scan(self.tmp_max_age_s)
        if removed:
            self._counters.add("tmp_removed", removed)
            logger.info("kvtier disk tier %s: removed %d stale temp files", self.root, removed)
        if foreign:  # not indexed: their bytes are not the tier's to account or evict
            logger.info("kvtier disk tier %s: ignored %d block files whose names are not "
                        "of this tier's layout (kvtier disk verify --repair removes them)",
                        self.root, foreign)
        return found

    def _load_scan(self, found: list[Scanned]) -> int:
        """Replace the index with a scan's result (keeping what changed meanwhile);
        the blocks it adds (at start: all) are reported stored, those gone from
        the directory (another engine's eviction or delete) removed."""
        with self._lock:
            before = self._index
            index: OrderedDict[bytes, int] = OrderedDict()
            removed = self._scan_removed
            for _mtime, key, acct in found:
                if key not in removed:
                    index[key] = acct
            for key in self._scan_added:
                acct_now = self._index.get(key)
                if acct_now is not None:
                    index[key] = acct_now
                    index.move_to_end(key)
            self._index = index
            self._indexed_bytes = sum(index.values())
            self._scanning = False
            self._scan_added = {}
            self._scan_removed = set()
            appeared: list[bytes] = []
            vanished: list[bytes] = []
            if self._events.enabled:  # a pass over both indexes, under the lock
                appeared = [k for k in index if k not in before]
                vanished = [k for k in before if k not in index]
            victims, _ = self._evict_locked(0)
        self._events.emit("stored", appeared)
        self._events.emit("removed", vanished, "gone")
        self._remove_victims(victims)
        return len(self._index)

    def rescan(self) -> int:
        """Re-read the directory now (other engines' stores and removals); returns blocks."""
        self._check_open()
        with self._lock:
            if self._scanning:
                return len(self._index)
            self._scanning = True
            self._last_scan = time.monotonic()
        try:
            found = self._scan()
        except BaseException:
            with self._lock:
                # The changes recorded for this scan end with it: kept, the next
                # scan would leave out the files of keys removed now and
                # stored again in between, which it finds on disk.
                self._scanning = False
                self._scan_added = {}
                self._scan_removed = set()
            raise
        return self._load_scan(found)

    # ------------------------------------------------------------------ index
    def _insert_locked(self, key: bytes, acct: int) -> None:
        old = self._index.get(key)
        if old is not None:
            self._indexed_bytes -= old
        self._index[key] = acct
        self._index.move_to_end(key)
        self._indexed_bytes += acct
        if self._scanning:
            self._scan_added[key] = None
            self._scan_removed.discard(key)

    def _forget_locked(self, key: bytes) -> bool:
        acct = self._index.pop(key, None)
        if self._scanning:
            self._scan_removed.add(key)
            self._scan_added.pop(key, None)
        if acct is None:
            return False
        self._indexed_bytes -= acct
        return True

    def _evict_locked(self, need: int, free_deficit: int = 0) -> tuple[list[bytes], int]:
        """Pop and unlink LRU blocks until ``need`` more bytes fit and ``free_deficit``
        bytes are freed; returns the victims (to report outside the lock) and bytes
        freed: those of the files it removed, not of entries whose file was gone
        already (another engine removed it), which free no space."""
        victims: list[bytes] = []
        freed = 0
        index = self._index
        while index and (
            self._indexed_bytes + self._pending_bytes + need > self.capacity_bytes
            or freed < free_deficit
        ):
            key, acct = index.popitem(last=False)
            self._indexed_bytes -= acct
            victims.append(key)
            # Unlinked under the lock: done later, it could remove the file of a
            # newer store of the same key that another thread made meanwhile.
            if unlink_quietly(self.dir.file(key)):
                freed += acct
            if self._scanning:
                self._scan_removed.add(key)
                self._scan_added.pop(key, None)
        return victims, freed

    def _remove_victims(self, victims: list[bytes]) -> None:
        """Count and report blocks ``_evict_locked`` removed."""
        if not victims:
            return
        self._counters.add("evictions", len(victims))
        self._events.emit("removed", victims, "evicted")

    # ------------------------------------------------------------------ reads
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored; keys not in this process's index cost one
        ``stat`` (blocks stored by other engines sharing the directory), through
        the lookup thread when there is one (``lookups``)."""
        return self._contains(keys, waiting=False)

    def contains_waiting(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` with the ``stat`` calls on the calling thread (an I/O
        thread), so that they never queue before the scheduler's lookups."""
        return self._contains(keys, waiting=True)

    def _contains(self, keys: Sequence[bytes], waiting: bool) -> list[bool]:
        self._check_open()
        keys = check_batch(keys)
        # Read without the lock, which a writer holds while it unlinks evicted
        # files (for long, when a rescan evicts thousands): this runs on the
        # scheduler's thread. Each membership test is atomic, and an answer can
        # be stale the moment the lock is released anyway (a read checks the file).
        index = self._index
        out = [k in index for k in keys]
        unknown = [i for i, held in enumerate(out)
                   if not held and len(keys[i]) <= MAX_DISK_KEY_BYTES]
        if not unknown:
            return out
        asked = [keys[i] for i in unknown]
        if waiting:
            found: list[bool] | None = self._find_written_by_others(asked)
        elif self._lookups is None:  # on the scheduler's thread: never wait for a writer
            found = self._find_written_by_others(asked, wait_for_lock=False)
        else:
            found = self._lookups.run(lambda: self._find_written_by_others(asked))
        for i, held in zip(unknown, found or (), strict=False):
            out[i] = held
        return out

    def _find_written_by_others(self, keys: list[bytes],
                                wait_for_lock: bool = True) -> list[bool]:
        """Look for the files of ``keys`` (not in the index), indexing those
        found (without ``wait_for_lock``, only while no writer holds the lock:
        a block left out is indexed at a later lookup, and reads need no index)."""
        out = []
        for key in keys:
            try:
                st = os.stat(self.dir.file(key), follow_symlinks=False)
            except OSError:
                out.append(False)
                continue
            out.append(stat.S_ISREG(st.st_mode))
            if out[-1]:
                self._adopt(key, st.st_size, wait_for_lock)
        return out

    def _adopt(self, key: bytes, size: int, wait_for_lock: bool = True) -> None:
        """Index a block another engine wrote (if the lock is free, without
        ``wait_for_lock``)."""
        if not self._lock.acquire(blocking=wait_for_lock):
            return
        try:
            # Checked under the lock: a block this process evicted meanwhile is gone.
            if key in self._index or key in self._pending or not os.path.exists(self.dir.file(key)):
                return
            self._insert_locked(key, allocated(size))
            victims, _ = self._evict_locked(0)
        finally:
            self._lock.release()
        self._counters.add("discovered")
        self._events.emit("stored", [key])
        self._remove_victims(victims)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self._check_open()
        keys = check_batch(keys)
        check_buffers(keys, buffers)
        views = [blockfile.byte_view(b, writable=True) for b in buffers]
        return [self._read(key, view)[0] for key, view in zip(keys, views, strict=True)]

    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        self._check_open()
        keys = check_batch(keys)
        return [self._read(key, None)[1] for key in keys]

    def _read(self, key: bytes, dest: memoryview | None) -> tuple[int | None, memoryview | None]:
        if len(key) > MAX_DISK_KEY_BYTES:
            self._counters.add("misses")
            return None, None
        path = self.dir.file(key)
        try:
            fd = os.open(path, _O_READ)
        except FileNotFoundError:
            return self._miss(key, gone=True)
        except OSError as exc:
            self._counters.add("errors")
            self._warn.warning("kvtier disk tier: cannot open %s: %s", path, exc)
            return self._miss(key)
        try:
            n, target, size = self._read_block(fd, key, dest)
        except CorruptBlockError as exc:
            self._corrupt(key, path, fd, exc)
            return None, None
        except OSError as exc:
            self._counters.add("errors")
            self._warn.warning("kvtier disk tier: cannot read %s: %s", path, exc)
            return self._miss(key)
        finally:
            os.close(fd)
        self._note_hit(key, path, size)
        return n, target

    def _read_block(self, fd: int, key: bytes,
                    dest: memoryview | None) -> tuple[int, memoryview, int]:
        """Read and verify the open block file of ``key`` into ``dest`` (a new
        buffer when None): (payload bytes, the payload's view, file size).
        ``CorruptBlockError`` when it is not a whole, valid block of ``key``."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # not ours: a miss, left in place
            raise OSError(errno.EINVAL, "not a regular file")
        hsize = blockfile.header_size(self._ns, key)
        n = st.st_size - hsize
        if n < 0:
            raise CorruptBlockError("truncated", f"{st.st_size} bytes")
        if n > (self.max_block_bytes or self.capacity_bytes):
            raise CorruptBlockError("oversized", f"{n} bytes")
        if dest is None:
            target = memoryview(bytearray(n))
        elif n > dest.nbytes:
            raise CorruptBlockError("payload larger than buffer", f"{n} > {dest.nbytes} bytes")
        else:
            target = dest[:n]
        head = bytearray(hsize)
        got = _pread_full(fd, [memoryview(head), target], 0)
        if got != st.st_size:
            raise CorruptBlockError("truncated", f"read {got} of {st.st_size} bytes")
        header = blockfile.unpack_header(head, namespace=self._ns, key=key)
        blockfile.verify(header, target)
        if self.touch_on_hit:
            with contextlib.suppress(OSError):
                os.utime(fd)
        return n, target, st.st_size

    def _note_hit(self, key: bytes, path: str, size: int) -> None:
        """Count a hit; the key becomes the most recent, indexed if it was not
        (a file another engine wrote, unless this tier evicted it meanwhile)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                adopted = False
            else:
                adopted = key not in self._pending and os.path.exists(path)
                if adopted:
                    self._insert_locked(key, allocated(size))
            victims = self._evict_locked(0)[0] if adopted else []
        self._counters.add("hits")
        if adopted:
            self._counters.add("discovered")
            self._events.emit("stored", [key])
            self._remove_victims(victims)

    def _miss(self, key: bytes, gone: bool = False) -> tuple[None, None]:
        if gone:
            forgot = self._forget_unless_replaced(key, None)
            if forgot:  # removed by another engine sharing the directory
                self._events.emit("removed", [key], "gone")
        self._counters.add("misses")
        return None, None

    def _forget_unless_replaced(self, key: bytes, bad: os.stat_result | None) -> bool:
        """Drop ``key`` from the index, unless its path now holds a file other
        than ``bad`` (None: any file). Checked under the lock: another thread
        may have stored the key again since the read, and forgetting that
        store would leave its file on disk in no index, its bytes outside
        ``capacity_bytes`` until a rescan."""
        path = self.dir.file(key)
        with self._lock:
            try:
                now = os.stat(path, follow_symlinks=False)
            except OSError:
                now = None
            if now is not None and (
                bad is None or (now.st_dev, now.st_ino) != (bad.st_dev, bad.st_ino)
            ):
                return False
            return self._forget_locked(key)

    def _corrupt(self, key: bytes, path: str, fd: int, exc: CorruptBlockError) -> None:
        """Remove the bad file (unless another engine replaced it meanwhile)."""
        mine: os.stat_result | None = None
        try:
            mine = os.fstat(fd)
            now = os.stat(path, follow_symlinks=False)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                unlink_quietly(path)
        except OSError:
            pass
        self._forget_unless_replaced(key, mine)
        self._counters.add("corrupt")
        self._counters.add("misses")
        self._events.emit("corrupt", [key], exc.reason)
        self._warn.warning("kvtier disk tier: removed %s: %s", path, exc)

    # ------------------------------------------------------------------ writes
    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        """Store blocks; see the module docstring for capacity and free space."""
        self._check_open()
        keys, views = check_items(items)
        for key, view in zip(keys, views, strict=True):
            self._check_key(key)
            if self.max_block_bytes is not None and view.nbytes > self.max_block_bytes:
                raise ValueError(
                    f"payload of {view.nbytes} bytes exceeds the disk tier's "
                    f"max_block_bytes={self.max_block_bytes}"
                )
        if (
            self.rescan_interval_s is not None
            and time.monotonic() - self._last_scan >= self.rescan_interval_s
        ):
            try:
                self.rescan()
            except OSError as exc:
                self._counters.add("errors")
                self._warn.warning("kvtier disk tier: cannot rescan %s: %s", self.root, exc)
        stored: list[bytes] = []
        out = []
        for key, view in zip(keys, views, strict=True):
            ok = self._put_one(key, view)
            out.append(ok)
            if ok is True:
                stored.append(key)
        self._events.emit("stored", stored)
        return [ok is not False for ok in out]

    def _put_one(self, key: bytes, view: memoryview) -> bool | None:
        """True: written; None: already there (or being written); False: dropped."""
        path = self.dir.file(key)
        size = blockfile.header_size(self._ns, key) + view.nbytes
        acct = allocated(size)
        with self._lock:
            known = key in self._index
            busy = key in self._pending
        if busy or (known and os.path.exists(path)):
            self._counters.add("duplicates")
            return None
        if acct > self.capacity_bytes:
            self._counters.add("dropped_stores")
            return False
        reserved = self._reserve(key, acct, known)
        if not reserved:
            return reserved
        ok = False
        try:
            ok = self._write(key, path, view)
        finally:  # also when the write raises: a reservation kept would never end
            with self._lock:
                self._pending.pop(key, None)
                self._pending_bytes -= acct
                if ok:
                    self._insert_locked(key, acct)
        if ok:
            self._counters.add("stores")
        return ok

    def _reserve(self, key: bytes, acct: int, known: bool) -> bool | None:
        """Reserve ``acct`` bytes for ``key``'s write (``_pending``), evicting
        least recently used blocks for the capacity and the free-space reserve.
        True: reserved; None: another thread stores the key; False: no room
        (counted). ``known``: the key was indexed, its file found gone.

        Reservations are made one at a time (``_reserve_lock``), each counting
        the writes reserved before it that have not ended: their bytes may not
        show in the free space yet. Read before the free space, a write that
        ends meanwhile counts twice (a block more evicted or a store dropped),
        never not at all; else concurrent writers would each take the same
        last room and overrun the reserve by a block per extra thread."""
        victims: list[bytes] = []
        with self._reserve_lock:
            deficit = self._free_deficit(acct + self._pending_bytes)
            with self._lock:
                if key in self._pending or (key in self._index and not known):
                    self._counters.add("duplicates")  # another thread stored it meanwhile
                    return None
                self._forget_locked(key)  # known but its file is gone: rewrite it
                fits = self._pending_bytes + acct <= self.capacity_bytes
                if fits:
                    victims, freed = self._evict_locked(acct, max(deficit, 0))
                    fits = freed >= deficit and (
                        self._indexed_bytes + self._pending_bytes + acct <= self.capacity_bytes
                    )
                if fits:
                    self._pending[key] = acct
                    self._pending_bytes += acct
        self._remove_victims(victims)
        if not fits:
            self._counters.add("dropped_stores")
            if deficit > 0:
                self._counters.add("no_space")
        return fits

    def _free_deficit(self, need: int) -> int:
        """Bytes to free so that ``need`` more bytes leave the free-space reserve
        whole (<= 0: none); 0 when the free space cannot be read."""
        try:
            return self.free_reserve_bytes + need - self._free_space(str(self.root))
        except OSError as exc:
            self._counters.add("errors")
            self._warn.warning("kvtier disk tier: cannot read free space of %s: %s",
                               self.root, exc)
            return 0

    def _write(self, key: bytes, path: str, view: memoryview) -> bool:
        header = blockfile.pack_header(self._ns, key, view)
        tmp = self.dir.temp_file(key, next(self._tmp_serial))
        # Removed on failure only if created here: one already there
        # (FileExistsError) is another writer's with this pid, in another container.
        created = False
        try:
            fd = self._create_temp(tmp)
            created = True
            try:
                hold_lock(fd)  # until the rename: scans elsewhere leave the temp file alone
                write_full(fd, [memoryview(header), view])
                if self.fsync:
                    os.fsync(fd)
                os.rename(tmp, path)
            finally:
                os.close(fd)
        except OSError as exc:
            if created:
                unlink_quietly(tmp)
            self._counters.add("dropped_stores")
            if exc.errno in _NO_SPACE:
                self._counters.add("no_space")
                logger.info("kvtier disk tier: no space for %s: store dropped", path)
            else:
                self._counters.add("errors")
                self._warn.warning("kvtier disk tier: cannot write %s: %s", path, exc)
            return False
        return True

    def _create_temp(self, tmp: str) -> int:
        """Open the new temp file ``tmp`` (``O_EXCL``); directories removed
        under the tier are made again."""
        try:
            return os.open(tmp, O_WRITE, 0o600)
        except FileNotFoundError:
            self.dir.remake()
            return os.open(tmp, O_WRITE, 0o600)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        keys = check_batch(keys)
        removed = []
        for key in keys:
            if len(key) > MAX_DISK_KEY_BYTES:
                continue
            with self._lock:  # unlink under the lock, as in _evict_locked
                self._forget_locked(key)
                if unlink_quietly(self.dir.file(key)):
                    removed.append(key)
        self._events.emit("removed", removed, "deleted")
        return len(removed)

    # ------------------------------------------------------------------ status
    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(self._counters.snapshot())
        # without the lock (see contains): figures of one moment each, not one snapshot
        out["blocks"] = len(self._index)
        out["used_bytes"] = self._indexed_bytes
        out["pending_bytes"] = self._pending_bytes
        out["capacity_bytes"] = self.capacity_bytes
        out["free_reserve_bytes"] = self.free_reserve_bytes
        out["rebuild_s"] = round(self.rebuild_s, 6)
        out["events_dropped"] = self._events.dropped
        out["lookup_timeouts"] = self._lookups.timeouts if self._lookups is not None else 0
        out["lookups"] = "thread" if self._lookups is not None else "inline"
        return out

    def take_events(self) -> list[TierEvent]:
        return self._events.take()

    def debug_state(self) -> dict[str, int]:
        """Entries of the index (at most ``capacity_bytes // 4096``), of the
        writes in flight (at most the writer threads), of a rescan's change
        sets (empty between rescans) and of the pending events (``max_events``).
        Read without the lock, as ``stats``."""
        return {"index": len(self._index), "pending": len(self._pending),
                "scan_added": len(self._scan_added),
                "scan_removed": len(self._scan_removed), "events": len(self._events)}

    def indexed_keys(self) -> list[bytes]:
        """Keys in this process's index, least recently used first."""
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        """Stop serving; the files stay for the next engine (warm restart)."""
        self._closed = True
        if self._lookups is not None:
            self._lookups.close()

    def __repr__(self) -> str:
        return (
            f"DiskTier({str(self.path)!r}, namespace={self.namespace!r}, "
            f"capacity_bytes={self.capacity_bytes})"
        )


def _int_setting(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TierConfigError(f"disk tier: {name} must be an int >= {low}, got {value!r}")
    return value

