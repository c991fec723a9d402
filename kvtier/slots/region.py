"""Fixed-size CPU slots in POSIX shared memory, mapped by several processes.

A region is one file under ``/dev/shm`` (tmpfs): a one-page header followed by
``num_slots`` slots of ``slot_bytes`` bytes each, every slot starting on an
``alignment`` boundary. The engine creates it once; the scheduler-side tier
threads and the workers attach to it by name.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import stat
import struct
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import numpy as np
import numpy.typing as npt

from kvtier.file_locks import hold_lock, is_locked
from kvtier.slots.reaper import RegionReaper

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PREFIX = "kvtier-"
SUFFIX = ".slots"
TMP_SUFFIX = ".tmp"
DEFAULT_ALIGNMENT = 4096
_MAGIC = b"KVTSLOT1"
_VERSION = 1
# magic, version, data_offset, num_slots, slot_bytes, slot_stride,
# creator_pid, creator_start_ticks
_HEADER = struct.Struct("<8sIIQQQQQ")
_ENGINE_ID_BYTES = 128
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_SAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
_NAME_PID = re.compile(r"-(\d+)\.slots$")
_TMP_PID = re.compile(r"\.(\d+)\.[0-9a-f]{8}\.tmp$")

U8Array = npt.NDArray[np.uint8]


def default_shm_dir() -> Path:
    """``/dev/shm`` where it exists (Linux), else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def region_name(engine_id: str, pid: int | None = None) -> str:
    """File name of the region an engine's creator process ``pid`` owns."""
    safe = _SAFE_CHARS.sub("_", engine_id)[:64] or "engine"
    return f"{PREFIX}{safe}-{os.getpid() if pid is None else pid}{SUFFIX}"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _proc_stat(pid: int) -> list[str]:
    """Fields 3.. of ``/proc/PID/stat`` (state first), [] when unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    # The command name (field 2) may contain spaces and ')': split after the last ')'.
    return text.rsplit(")", 1)[-1].split()


def _process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 when unknown)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if len(fields) > 19 else 0


def pid_alive(pid: int, start_ticks: int = 0) -> bool:
    """Whether ``pid`` runs and, when ``start_ticks`` is known, is the same process.

    A zombie is dead: it holds no file or mapping any more, and where the init
    process does not reap (some containers) it would stay "alive" for ever.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False
    if start_ticks:
        current = int(fields[19]) if len(fields) > 19 else 0
        return current in (0, start_ticks)
    return True


@dataclass(frozen=True)
class RegionHeader:
    """Geometry and owner of a region, as stored in its first page."""

    data_offset: int
    num_slots: int
    slot_bytes: int
    slot_stride: int
    creator_pid: int
    creator_start_ticks: int
    engine_id: str

    def pack(self) -> bytes:
        fixed = _HEADER.pack(
            _MAGIC,
            _VERSION,
            self.data_offset,
            self.num_slots,
            self.slot_bytes,
            self.slot_stride,
            self.creator_pid,
            self.creator_start_ticks,
        )
        engine = self.engine_id.encode()[:_ENGINE_ID_BYTES]
        return fixed + engine.ljust(_ENGINE_ID_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes, source: str) -> RegionHeader:
        size = _HEADER.size + _ENGINE_ID_BYTES
        if len(raw) < size:
            raise ValueError(f"{source}: too short for a kvtier slot region header")
        magic, version, offset, slots, nbytes, stride, pid, ticks = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(
                f"{source}: not a kvtier slot region (magic {magic!r}, version {version})"
            )
        engine = raw[_HEADER.size : size].rstrip(b"\0").decode(errors="replace")
        return cls(offset, slots, nbytes, stride, pid, ticks, engine)

    @classmethod
    def read(cls, path: Path) -> RegionHeader:
        """The header of the region file at ``path`` (``open_region_file``'s checks)."""
        fd = open_region_file(path, os.O_RDONLY)
        try:
            return cls.unpack(os.pread(fd, _HEADER.size + _ENGINE_ID_BYTES, 0), str(path))
        finally:
            os.close(fd)


# O_NONBLOCK: a FIFO put at a region's name by another user would block a
# plain open until a writer came (every engine's start, in its stale cleanup);
# O_NOFOLLOW: a symlink there is not a region this process made.
_O_REGION = os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def open_region_file(path: Path, flags: int) -> int:
    """Open ``path`` with ``flags`` (``os.O_RDONLY`` or ``os.O_RDWR``) if it is a
    region file this process may use: a regular file, not a symlink, owned by
    this process's user. ``/dev/shm`` is writable by every user, so anything
    else at a region's name (a FIFO, a device, another user's file with a
    header of its choosing) is refused: ``ValueError`` naming the problem,
    ``OSError`` when it cannot be opened (``ELOOP`` for a symlink)."""
    fd = os.open(path, flags | _O_REGION)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file, not a kvtier slot region")
        if st.st_uid != os.geteuid():
            raise ValueError(f"{path}: owned by uid {st.st_uid}, not by this process's "
                             f"user (uid {os.geteuid()}): not a region of this engine")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_geometry(num_slots: int, slot_bytes: int, alignment: int) -> None:
    for label, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment!r}")


def _check_free_space(directory: Path, needed: int) -> None:
    stats = os.statvfs(directory)
    available = stats.f_bavail * stats.f_frsize
    if needed > available:
        raise MemoryError(
            f"slot region needs {needed} bytes but {directory} has only {available} bytes "
            "free: lower the CPU tier's size (cpu_bytes_to_use) or give the shared-memory "
            "file system more room (e.g. docker --shm-size)"
        )


def _reserve_space(fd: int, total: int, directory: Path) -> None:
    """Allocate the region file's ``total`` bytes now (on tmpfs: its pages).

    A sparse file takes no room: the free-space check would pass for every
    region that fits alone (the ranks of one engine create theirs at once),
    and whichever then touched a page the file system no longer had would be
    killed by SIGBUS, at start-up or in the middle of a copy. Raises
    ``MemoryError`` when the room is not there; a file system without
    ``fallocate`` leaves the file sparse.
    """
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # not on every platform
        return
    try:
        fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
            raise MemoryError(
                f"slot region needs {total} bytes but {directory} cannot hold them "
                f"({exc.strerror}; other regions or files took its free space): lower "
                "the CPU tier's size (cpu_bytes_to_use) or give the shared-memory "
                "file system more room (e.g. docker --shm-size)"
            ) from exc
        raise


def cleanup_stale_regions(shm_dir: str | Path | None = None) -> list[Path]:
    """Remove regions (and half-created temp files) whose creator has died.

    The creator is read from the region's header (pid and process start time,
    so a reused pid does not keep a dead engine's region), from the pid in a
    temp file's name, or for an unreadable header from the ``-PID.slots`` name.
    Only this user's regular files are looked at: another user's, or a FIFO or
    symlink at such a name, is none of this engine's business (and a FIFO
    would block the read of its header). Returns the removed paths.
    """
    directory = Path(shm_dir) if shm_dir is not None else default_shm_dir()
    removed: list[Path] = []
    for path in directory.glob(f"{PREFIX}*"):
        if not _is_own_file(path) or not _is_stale(path):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another process cleaned it first
        except OSError as exc:  # e.g. another user's file in sticky /dev/shm
            logger.warning("cannot remove stale kvtier slot region %s: %s", path, exc)
            continue
        removed.append(path)
        logger.info("removed stale kvtier slot region %s", path)
    return removed


def region_creator(name: str, shm_dir: str | Path | None = None) -> tuple[int, int] | None:
    """``(pid, start_ticks)`` of the process that made region ``name``, if known."""
    directory = Path(shm_dir) if shm_dir is not None else default_shm_dir()
    return _creator_of(directory / name)


def _creator_of(path: Path) -> tuple[int, int] | None:
    """``(pid, start_ticks)`` of the process that made ``path``, if known."""
    tmp = _TMP_PID.search(path.name)
    if tmp is not None:
        return int(tmp.group(1)), 0
    try:
        header = RegionHeader.read(path)
    except (OSError, ValueError):
        named = _NAME_PID.search(path.name)
        return (int(named.group(1)), 0) if named else None
    return header.creator_pid, header.creator_start_ticks


def _is_own_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a symlink) of this process's user."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _is_stale(path: Path) -> bool:
    """Whether ``path``'s creator is gone: its pid names no such process, and
    no process holds the file's lock (the creator's, ``hold_lock``: a creator
    in another pid namespace, whose pid says nothing here, still holds it)."""
    creator = _creator_of(path)
    return creator is not None and not pid_alive(*creator) and not is_locked(path)


class SlotRegion:
    """A shared-memory array of ``num_slots`` fixed-size byte slots.

    Owns one memory mapping of the region file and, in the creating process,
    the file's name: the creator unlinks it on ``close()``/``unlink()``, at
    garbage collection or at interpreter exit. Attachers only unmap.

    Invariants:
      * slot ``i`` is the bytes ``[data_offset + i*slot_stride, +slot_bytes)``;
        ``slot_stride`` is ``slot_bytes`` rounded up to ``alignment`` and
        ``data_offset`` is a multiple of the page size and of ``alignment``;
      * the geometry never changes after creation and is stored in the header,
        so ``attach(name)`` needs only the name;
      * a region file is published under its final name only once fully sized
        and described, so an attacher never sees a partial region;
      * views returned by ``slot_array``/``as_numpy``/``as_torch`` share the
        mapping (no copies) and keep it alive after ``close()`` until they are
        dropped; the name is unlinked regardless.
    """

    def __init__(self, path: Path, header: RegionHeader, creator: bool,
                 lock_fd: int | None = None) -> None:
        """Map an existing, fully initialised region file (use create/attach);
        the creator passes the descriptor holding the file's lock, closed with
        the name."""
        self.path = path
        self.header = header
        self.is_creator = creator
        fd = open_region_file(path, os.O_RDWR)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.total_bytes)
        finally:
            os.close(fd)
        base = np.frombuffer(self._mmap, dtype=np.uint8)
        self._rows: U8Array | None = base[header.data_offset :].reshape(
            header.num_slots, header.slot_stride
        )
        self._slots: U8Array | None = self._rows[:, : header.slot_bytes]
        self._finalizer = (
            weakref.finalize(self, _unlink_if_owner, path, os.getpid(), lock_fd)
            if creator else None
        )
        self._reaper: RegionReaper | None = None

    # ------------------------------------------------------------------ create
    @classmethod
    def create(
        cls,
        engine_id: str,
        num_slots: int,
        slot_bytes: int,
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        shm_dir: str | Path | None = None,
        name: str | None = None,
        populate: bool = True,
        clean_stale: bool = True,
        reaper: bool = False,
    ) -> SlotRegion:
        """Create the engine's region (removing stale regions of dead engines).

        The file is ``name`` (default ``region_name(engine_id)``: engine id and
        this process's pid) under ``shm_dir`` (default ``/dev/shm``). Raises
        ``FileExistsError`` if that file exists and ``MemoryError`` if the
        shared-memory file system lacks room: the file's space is allocated
        here, so a region that was created never runs out of it later.
        ``populate`` pre-faults every page so later copies never page-fault.
        ``reaper``: a child process removes the file even if this process is
        killed (``kvtier.slots.reaper``).
        """
        _check_geometry(num_slots, slot_bytes, alignment)
        directory = Path(shm_dir) if shm_dir is not None else default_shm_dir()
        if clean_stale:
            cleanup_stale_regions(directory)
        header = cls._new_header(engine_id, num_slots, slot_bytes, alignment)
        total = header.data_offset + num_slots * header.slot_stride
        _check_free_space(directory, total)
        path = directory / (name or region_name(engine_id))
        lock_fd = cls._publish(path, header, total)
        try:
            region = cls(path, header, creator=True, lock_fd=lock_fd)
        except BaseException:
            _unlink_if_owner(path, os.getpid(), lock_fd)
            raise
        try:
            if reaper:
                region._reaper = RegionReaper(path)
            if populate:
                region._populate()
        except BaseException:
            region.close()  # unlinks and releases the lock, once
            raise
        return region

    @staticmethod
    def _new_header(
        engine_id: str, num_slots: int, slot_bytes: int, alignment: int
    ) -> RegionHeader:
        pid = os.getpid()
        return RegionHeader(
            data_offset=_round_up(_HEADER.size + _ENGINE_ID_BYTES, max(alignment, mmap.PAGESIZE)),
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            slot_stride=_round_up(slot_bytes, alignment),
            creator_pid=pid,
            creator_start_ticks=_process_start_ticks(pid),
            engine_id=engine_id,
        )

    @staticmethod
    def _publish(path: Path, header: RegionHeader, total: int) -> int:
        """Size a temp file, write the header, then hard-link it to ``path``;
        return the descriptor that holds its lock (the caller closes it)."""
        stem = path.name.removesuffix(SUFFIX)
        tmp = path.with_name(f"{stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            hold_lock(fd)  # for the region's life: no other engine's cleanup removes it
            os.ftruncate(fd, total)
            _reserve_space(fd, total, path.parent)
            os.pwrite(fd, header.pack(), 0)
            os.link(tmp, path)  # fails with FileExistsError, unlike rename
        except FileExistsError as exc:
            os.close(fd)
            raise FileExistsError(
                errno.EEXIST,
                f"slot region {path} already exists; an engine creates its "
                "region once (close it first or pass another name)",
            ) from exc
        except BaseException:
            os.close(fd)
            raise
        finally:
            _unlink_quietly(tmp)
        return fd

    def _populate(self) -> None:
        """Pre-fault all pages for writing without changing their contents."""
        if self._mmap is None:
            return
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, 0, self.total_bytes)
        except (OSError, ValueError):
            base = np.frombuffer(self._mmap, dtype=np.uint8)
            base[:: mmap.PAGESIZE] |= 0
            del base

    # ------------------------------------------------------------------ attach
    @classmethod
    def attach(
        cls,
        name: str | Path,
        *,
        shm_dir: str | Path | None = None,
        num_slots: int | None = None,
        slot_bytes: int | None = None,
    ) -> SlotRegion:
        """Map an existing region by file name (or path).

        When ``num_slots``/``slot_bytes`` are given they must match the header.
        ``ValueError`` for anything at that name but this user's regular file
        (``open_region_file``): another user could have put it in ``/dev/shm``.
        """
        path = Path(name)
        if not path.is_absolute():
            directory = Path(shm_dir) if shm_dir is not None else default_shm_dir()
            path = directory / path
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, f"no slot region at {path}")
        header = RegionHeader.read(path)
        cls._check_expected(header, num_slots, slot_bytes, path)
        size = path.stat(follow_symlinks=False).st_size
        expected = header.data_offset + header.num_slots * header.slot_stride
        if size < expected:
            raise ValueError(f"{path}: file has {size} bytes, header needs {expected}")
        return cls(path, header, creator=False)

    @staticmethod
    def _check_expected(
        header: RegionHeader,
        num_slots: int | None,
        slot_bytes: int | None,
        path: Path,
    ) -> None:
        for label, want, got in (
            ("num_slots", num_slots, header.num_slots),
            ("slot_bytes", slot_bytes, header.slot_bytes),
        ):
            if want is not None and want != got:
                raise ValueError(f"{path}: expected {label}={want}, region has {got}")

    # ------------------------------------------------------------------ geometry
    @property
    def name(self) -> str:
        """The file name other processes pass to ``attach``."""
        return self.path.name

    @property
    def num_slots(self) -> int:
        return self.header.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.header.slot_bytes

    @property
    def slot_stride(self) -> int:
        return self.header.slot_stride

    @property
    def total_bytes(self) -> int:
        """Bytes mapped: header page plus every slot with its padding."""
        return self.header.data_offset + self.num_slots * self.slot_stride

    @property
    def closed(self) -> bool:
        return self._slots is None

    # ------------------------------------------------------------------ views
    def _array(self, padded: bool = False) -> U8Array:
        array = self._rows if padded else self._slots
        if array is None:
            raise ValueError(f"slot region {self.name} is closed")
        return array

    def check_slot(self, slot_id: int | np.integer) -> int:
        """Return ``slot_id`` as an int, or raise if it is not a valid slot."""
        if isinstance(slot_id, bool) or not isinstance(slot_id, (int, np.integer)):
            raise TypeError(f"slot id must be an int, got {type(slot_id).__name__}")
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(
                f"slot id {slot_id} out of range for region {self.name} with {self.num_slots} slots"
            )
        return int(slot_id)

    def slot_array(self, slot_id: int | np.integer) -> U8Array:
        """The ``slot_bytes`` bytes of one slot as a writable uint8 view."""
        return self._array()[self.check_slot(slot_id)]

    def as_numpy(self, padded: bool = False) -> U8Array:
        """All slots as a ``(num_slots, slot_bytes)`` uint8 view with row stride
        ``slot_stride``; ``padded=True`` gives ``(num_slots, slot_stride)``
        contiguous rows including each slot's alignment padding."""
        return self._array(padded)

    def as_torch(self, dtype: torch.dtype | None = None, padded: bool = False) -> torch.Tensor:
        """All slots as a CPU tensor sharing memory, shaped like ``as_numpy``.

        ``dtype`` may be ``torch.uint8`` (default) or ``torch.int8``.
        """
        import torch

        tensor = torch.from_numpy(self._array(padded))
        if dtype is None or dtype == torch.uint8:
            return tensor
        if dtype == torch.int8:
            return tensor.view(torch.int8)
        raise ValueError(f"as_torch supports uint8 or int8, got {dtype}")

    def base_address(self) -> int:
        """Address of slot 0 in this process (for host-memory registration)."""
        return int(self._array().ctypes.data)

    @property
    def slots_nbytes(self) -> int:
        """Bytes from slot 0 to the end of the last slot's padding."""
        return self.num_slots * self.slot_stride

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unmap (once no views remain) and, in the creator, unlink the name."""
        if self._slots is None:
            return
        self._slots = self._rows = None
        if self.is_creator:
            self.unlink()
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                # Views handed out are still alive: the mapping is released
                # when the last of them is garbage collected.
                logger.debug("slot region %s: views outlive close()", self.name)

    def unlink(self) -> None:
        """Remove the region's name; mappings stay valid until closed."""
        if self._finalizer is not None:
            self._finalizer()  # unlinks once, idempotent
        else:
            _unlink_quietly(self.path)
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"SlotRegion({self.name!r}, num_slots={self.num_slots}, "
            f"slot_bytes={self.slot_bytes}, {state})"
        )


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _unlink_if_owner(path: Path, owner_pid: int, lock_fd: int | None) -> None:
    """Unlink ``path`` and release its lock, unless running in a forked child
    of the creator."""
    if os.getpid() == owner_pid:
        _unlink_quietly(path)
        if lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock_fd)
