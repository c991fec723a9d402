"""Batched block copies between an engine's KV tensors and CPU slots.

The engine's KV cache is a list of *canonical tensors*, each viewed as
``(num_blocks, page_bytes)`` bytes. One offloaded block of KV group ``g`` is the
concatenation of that block's page in every tensor of group ``g``; it is stored
in one slot of a :class:`~kvtier.slots.region.SlotRegion`.

On CPU the copies are plain memory copies done by numpy (which releases the
GIL), optionally on a few threads. On CUDA the region is registered as pinned
host memory and copies run on a dedicated stream, tracked with events, so the
engine never waits for them.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvtier.slots.region import SlotRegion

logger = logging.getLogger(__name__)

Direction = Literal["store", "load"]
IntArray = npt.NDArray[np.int64]
U8Array = npt.NDArray[np.uint8]

# Pages at least this large are copied run by run (consecutive ids coalesced);
# smaller pages are gathered and scattered with one fancy-indexed copy per
# tensor, which costs two passes but far fewer Python calls.
ROW_COPY_MIN_BYTES = 16 * 1024
# Smaller jobs are copied by the calling thread alone: handing them to the copy
# pool costs more than it saves.
PARALLEL_MIN_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one store or load job."""

    job_id: int
    success: bool
    num_bytes: int = 0
    seconds: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class SlotLayout:
    """Where each canonical tensor's page sits inside a slot, per KV group.

    Invariants: ``groups[g]`` lists distinct tensor indices; ``offsets[g][k]`` is
    the byte offset of tensor ``groups[g][k]`` in a group-``g`` slot, pages are
    packed back to back from offset 0 in group order.
    """

    page_bytes: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]

    @classmethod
    def build(
        cls, page_bytes: Sequence[int], groups: Sequence[Sequence[int]] | None = None
    ) -> SlotLayout:
        """Pack pages per group; ``groups=None`` puts every tensor in group 0."""
        pages = tuple(int(p) for p in page_bytes)
        if not pages or min(pages) <= 0:
            raise ValueError(f"page sizes must be positive, got {pages}")
        members = [tuple(range(len(pages)))] if groups is None else groups
        grouped: list[tuple[int, ...]] = []
        offsets: list[tuple[int, ...]] = []
        for g, group in enumerate(members):
            tensor_ids = tuple(dict.fromkeys(int(t) for t in group))
            if not tensor_ids or not all(0 <= t < len(pages) for t in tensor_ids):
                raise ValueError(f"group {g} has bad tensor indices {list(group)}")
            starts = np.cumsum([0] + [pages[t] for t in tensor_ids[:-1]])
            grouped.append(tensor_ids)
            offsets.append(tuple(int(s) for s in starts))
        return cls(pages, tuple(grouped), tuple(offsets))

    def group_bytes(self, group: int) -> int:
        """Bytes of one group-``group`` block in a slot."""
        return sum(self.page_bytes[t] for t in self.groups[group])

    @property
    def max_slot_bytes(self) -> int:
        """Slot size needed to hold a block of any group."""
        return max(self.group_bytes(g) for g in range(len(self.groups)))


@dataclass(frozen=True)
class Segment:
    """The blocks of one KV group inside a job: ``engine_ids[i] <-> slot_ids[i]``."""

    group: int
    engine_ids: IntArray
    slot_ids: IntArray


@dataclass(frozen=True)
class Batch:
    """A validated job: its segments and how many bytes it moves."""

    job_id: int
    direction: Direction
    segments: tuple[Segment, ...]
    num_bytes: int


def as_block_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` (leading dim = blocks) as ``(num_blocks, page_bytes)`` uint8.

    Never copies: raises ``ValueError`` when no such view exists.
    """
    if tensor.dim() < 1 or tensor.shape[0] <= 0:
        raise ValueError(f"KV tensor needs a leading block dim, got {tuple(tensor.shape)}")
    try:
        rows = tensor.view(tensor.shape[0], -1)
        if rows.element_size() != 1:
            rows = rows.view(torch.uint8)
        return rows.view(torch.uint8)
    except RuntimeError as exc:
        raise ValueError(
            f"KV tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} "
            "cannot be viewed as (num_blocks, page_bytes) bytes without a copy"
        ) from exc


def _as_ids(values: Any, label: str) -> IntArray:
    ids = np.asarray(values)
    if ids.ndim != 1:
        raise ValueError(f"{label} must be one-dimensional, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{label} must be integers, got dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def _check_range(ids: IntArray, limit: int, label: str) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise IndexError(f"{label} contains {bad}, outside [0, {limit})")


def _check_unique(ids: IntArray, label: str) -> None:
    if ids.size > 1 and np.unique(ids).size != ids.size:
        raise ValueError(f"{label} has duplicates; each destination is written once")


def coalesce_runs(src: IntArray, dst: IntArray) -> list[tuple[int, int, int]]:
    """Split paired ids into maximal runs where both advance by one.

    Returns ``(src_start, dst_start, length)`` triples in input order.
    """
    if src.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return [
        (int(src[s]), int(dst[s]), int(n))
        for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)
    ]


class _Copier(Protocol):
    """A backend that runs validated batches and reports their results."""

    def submit(self, batch: Batch) -> None: ...

    def poll(self) -> list[TransferResult]: ...

    def wait(self, job_ids: set[int]) -> None: ...

    def close(self) -> None: ...


class TransferWorker:
    """Copies KV blocks between engine tensors and the slots of a region.

    Owns: byte views of the engine's canonical KV tensors (not their memory), a
    reference to the region, and the copy backend (CPU copies, or a CUDA stream,
    events and pinned registration of the region).

    Invariants: every engine tensor has the same number of blocks; a slot holds
    one block of one KV group laid out by :class:`SlotLayout`, and fits in
    ``region.slot_bytes``; every submitted job yields exactly one
    :class:`TransferResult` from ``get_finished`` - a job that fails (bad ids,
    a copy error) is reported with ``success=False`` and never raises.
    """

    def __init__(
        self,
        kv_tensors: Sequence[torch.Tensor],
        region: SlotRegion,
        *,
        groups: Sequence[Sequence[int]] | None = None,
        copy_threads: int = 1,
        asynchronous: bool = False,
    ) -> None:
        """``groups[g]`` lists the tensor indices of KV group ``g`` (default: all
        tensors form group 0). On CPU, ``copy_threads`` threads share each copy
        and ``asynchronous`` runs jobs in order on a background thread."""
        if not kv_tensors:
            raise ValueError("TransferWorker needs at least one KV tensor")
        self.tensors = [as_block_bytes(t) for t in kv_tensors]
        self.num_blocks = self._common_num_blocks(self.tensors)
        self.layout = SlotLayout.build([t.shape[1] for t in self.tensors], groups)
        if self.layout.max_slot_bytes > region.slot_bytes:
            raise ValueError(
                f"a block needs {self.layout.max_slot_bytes} bytes but region "
                f"{region.name} has {region.slot_bytes}-byte slots"
            )
        self.region = region
        self._failed: deque[TransferResult] = deque()
        self._copier = self._make_copier(copy_threads, asynchronous)

    @staticmethod
    def _common_num_blocks(tensors: Sequence[torch.Tensor]) -> int:
        counts = {int(t.shape[0]) for t in tensors}
        if len(counts) != 1:
            raise ValueError(f"KV tensors disagree on num_blocks: {sorted(counts)}")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"KV tensors live on several devices: {devices}")
        return counts.pop()

    def _make_copier(self, copy_threads: int, asynchronous: bool) -> _Copier:
        device = self.tensors[0].device
        if device.type == "cpu":
            return CpuCopier(self, copy_threads, asynchronous)
        if device.type == "cuda" and torch.cuda.is_available():
            return CudaCopier(self)
        raise ValueError(f"unsupported KV tensor device {device}")

    # ------------------------------------------------------------------ jobs
    def store(
        self,
        job_id: int,
        engine_block_ids: Any,
        slot_ids: Any,
        group_sizes: Sequence[int] | None = None,
    ) -> None:
        """Copy engine blocks into slots (engine -> CPU), one job."""
        self._submit(job_id, "store", engine_block_ids, slot_ids, group_sizes)

    def load(
        self,
        job_id: int,
        slot_ids: Any,
        engine_block_ids: Any,
        group_sizes: Sequence[int] | None = None,
    ) -> None:
        """Copy slots into engine blocks (CPU -> engine), one job."""
        self._submit(job_id, "load", engine_block_ids, slot_ids, group_sizes)

    def _submit(
        self,
        job_id: int,
        direction: Direction,
        engine_block_ids: Any,
        slot_ids: Any,
        group_sizes: Sequence[int] | None,
    ) -> None:
        try:
            batch = self.make_batch(job_id, direction, engine_block_ids, slot_ids, group_sizes)
            self._copier.submit(batch)
        except Exception as exc:  # reported as success=False
            logger.warning("kvtier %s job %s failed: %s", direction, job_id, exc)
            self._failed.append(TransferResult(job_id, False, error=repr(exc)))

    def make_batch(
        self,
        job_id: int,
        direction: Direction,
        engine_block_ids: Any,
        slot_ids: Any,
        group_sizes: Sequence[int] | None = None,
    ) -> Batch:
        """Validate ids and split them by KV group (raises on bad input)."""
        engine = _as_ids(engine_block_ids, "engine block ids")
        slots = _as_ids(slot_ids, "slot ids")
        if engine.size != slots.size:
            raise ValueError(f"{engine.size} engine block ids but {slots.size} slot ids")
        _check_range(engine, self.num_blocks, "engine block ids")
        _check_range(slots, self.region.num_slots, "slot ids")
        _check_unique(slots if direction == "store" else engine, f"{direction} target")
        sizes = self._group_sizes(group_sizes, engine.size)
        segments, start = [], 0
        for group, size in enumerate(sizes):
            if size:
                end = start + size
                segments.append(Segment(group, engine[start:end], slots[start:end]))
                start = end
        num_bytes = sum(s.engine_ids.size * self.layout.group_bytes(s.group) for s in segments)
        return Batch(job_id, direction, tuple(segments), num_bytes)

    def _group_sizes(self, group_sizes: Sequence[int] | None, total: int) -> list[int]:
        if group_sizes is None:
            return [total]
        sizes = [int(s) for s in group_sizes]
        if len(sizes) > len(self.layout.groups) or min(sizes, default=0) < 0:
            raise ValueError(f"group sizes {sizes} do not fit {len(self.layout.groups)} KV groups")
        if sum(sizes) != total:
            raise ValueError(f"group sizes {sizes} sum to {sum(sizes)}, not {total}")
        return sizes

    # ------------------------------------------------------------------ results
    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call (never blocks)."""
        results = list(self._failed)
        self._failed.clear()
        return results + self._copier.poll()

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have finished (results stay queued)."""
        self._copier.wait(set(job_ids))

    def shutdown(self) -> None:
        """Finish in-flight jobs and release backend resources."""
        self._copier.close()


# ---------------------------------------------------------------------- CPU
@dataclass(frozen=True)
class _CopyTask:
    """One tensor's share of a batch: ``dst[dst_ids] = src[src_ids]``."""

    dst: U8Array
    dst_ids: IntArray
    src: U8Array
    src_ids: IntArray

    def run(self) -> None:
        if self.dst.shape[1] >= ROW_COPY_MIN_BYTES:
            for s, d, n in coalesce_runs(self.src_ids, self.dst_ids):
                self.dst[d : d + n] = self.src[s : s + n]
        else:
            self.dst[self.dst_ids] = self.src[self.src_ids]

    def split(self, parts: int) -> list[_CopyTask]:
        bounds = np.linspace(0, self.src_ids.size, parts + 1).astype(int)
        return [
            _CopyTask(self.dst, self.dst_ids[a:b], self.src, self.src_ids[a:b])
            for a, b in itertools.pairwise(bounds.tolist())
            if b > a
        ]


class CpuCopier:
    """CPU backend: numpy copies between engine tensors and slot columns.

    Owns numpy views of the engine tensors and region, an optional pool of copy
    threads, and an optional single background thread that runs jobs in
    submission order. Results are kept in submission order.
    """

    def __init__(self, worker: TransferWorker, copy_threads: int, asynchronous: bool):
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self._engine = [t.numpy() for t in worker.tensors]
        self._groups = worker.layout.groups
        self._columns = self._slot_columns(worker.layout, worker.region.as_numpy())
        self._threads = copy_threads
        self._pool = ThreadPoolExecutor(copy_threads, "kvtier-copy") if copy_threads > 1 else None
        self._runner = ThreadPoolExecutor(1, "kvtier-jobs") if asynchronous else None
        self._jobs: deque[tuple[int, Future[TransferResult]]] = deque()
        self._done: deque[TransferResult] = deque()
        self._lock = threading.Lock()

    @staticmethod
    def _slot_columns(layout: SlotLayout, slots: U8Array) -> list[list[U8Array]]:
        return [
            [slots[:, off : off + layout.page_bytes[t]] for t, off in zip(g, offs, strict=True)]
            for g, offs in zip(layout.groups, layout.offsets, strict=True)
        ]

    def tasks(self, batch: Batch) -> list[_CopyTask]:
        """One copy task per (segment, tensor) of the batch."""
        tasks = []
        for seg in batch.segments:
            members = zip(self._groups[seg.group], self._columns[seg.group], strict=True)
            for t, column in members:
                engine = self._engine[t]
                if batch.direction == "store":
                    tasks.append(_CopyTask(column, seg.slot_ids, engine, seg.engine_ids))
                else:
                    tasks.append(_CopyTask(engine, seg.engine_ids, column, seg.slot_ids))
        return tasks

    def run(self, batch: Batch) -> TransferResult:
        """Copy a batch now, in the calling thread (plus the copy pool)."""
        start = time.perf_counter()
        try:
            tasks = self.tasks(batch)
            if self._pool is None or batch.num_bytes < PARALLEL_MIN_BYTES:
                for task in tasks:
                    task.run()
            else:
                self._run_parallel(tasks)
        except Exception as exc:  # reported as success=False
            logger.warning("kvtier %s job %s failed: %s", batch.direction, batch.job_id, exc)
            return TransferResult(batch.job_id, False, error=repr(exc))
        return TransferResult(batch.job_id, True, batch.num_bytes, time.perf_counter() - start)

    def _run_parallel(self, tasks: list[_CopyTask]) -> None:
        if self._pool is None:
            raise RuntimeError("no copy pool")
        if len(tasks) < self._threads:
            tasks = [part for task in tasks for part in task.split(self._threads)]
        shards: list[list[_CopyTask]] = [tasks[i :: self._threads] for i in range(self._threads)]
        futures = [self._pool.submit(_run_all, shard) for shard in shards if shard]
        # every shard ends before a failure is reported: the caller frees or
        # reuses the job's slots and blocks then, and a shard still copying
        # would write into their next owner's bytes
        wait(futures)
        for future in futures:
            future.result()

    def submit(self, batch: Batch) -> None:
        if self._runner is None:
            self._done.append(self.run(batch))
            return
        with self._lock:
            self._jobs.append((batch.job_id, self._runner.submit(self.run, batch)))

    def poll(self) -> list[TransferResult]:
        results = list(self._done)
        self._done.clear()
        with self._lock:
            while self._jobs and self._jobs[0][1].done():
                results.append(self._jobs.popleft()[1].result())
        return results

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            pending = [f for job, f in self._jobs if job in job_ids]
        for future in pending:
            future.exception()  # waits; failures are reported by poll()

    def close(self) -> None:
        if self._runner is not None:
            self._runner.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _run_all(tasks: Sequence[_CopyTask]) -> None:
    for task in tasks:
        task.run()


# ---------------------------------------------------------------------- CUDA
@dataclass
class _CudaJob:
    """A batch in flight on the copy stream, with what it must keep alive."""

    batch: Batch
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep: list[torch.Tensor]
    error: str | None = None

    def result(self) -> TransferResult:
        if self.error is not None:
            return TransferResult(self.batch.job_id, False, error=self.error)
        try:
            seconds: float | None = self.start.elapsed_time(self.end) / 1000.0
        except RuntimeError:
            seconds = None
        return TransferResult(self.batch.job_id, True, self.batch.num_bytes, seconds)


_CUDA_HOST_MEMORY_ALREADY_REGISTERED = 712


def _clear_cuda_error() -> None:
    """Reset CUDA's last-error state after a failed runtime call (best effort),
    so a later kernel-launch check does not report our error as its own."""
    try:
        with open("/proc/self/maps") as maps:
            lib = next((ln.split()[-1] for ln in maps if "libcudart" in ln), None)
        if lib is not None:
            ctypes.CDLL(lib).cudaGetLastError()
    except (OSError, AttributeError):
        logger.debug("kvtier: could not clear the CUDA error state")


def _host_register(region: SlotRegion) -> int | None:
    """Pin the region's slots for DMA; returns the address to unregister, or
    None when this worker did not register them (already pinned, or failed)."""
    address, size = region.base_address(), region.slots_nbytes
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(address, size, 1))
    except (AttributeError, AssertionError, RuntimeError) as exc:
        logger.warning("kvtier: cannot pin slot region %s: %r", region.name, exc)
        return None
    if code == 0:
        return address
    _clear_cuda_error()
    if code != _CUDA_HOST_MEMORY_ALREADY_REGISTERED:
        logger.warning(
            "kvtier: could not pin slot region %s (cudaError %d); copies to it "
            "are pageable and may block the engine",
            region.name,
            code,
        )
    return None


def _host_unregister(address: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(address))
    if code != 0:
        _clear_cuda_error()
        logger.warning("kvtier: cudaHostUnregister failed (cudaError %d)", code)


class CudaCopier:
    """CUDA backend: copies on one dedicated stream, completion via events.

    Owns the copy stream, the in-flight jobs (with their staging buffers and
    index tensors, kept alive until the job's end event has completed) and the
    pinned-memory registration of the region's slots, undone by ``close()``.

    A store gathers the blocks' pages on the GPU into a staging buffer laid out
    like slots, then copies it to the slots (one copy per run of consecutive
    slot ids); a load does the reverse. Every job first waits for the work
    already queued on the engine's current stream, and jobs run in submission
    order. The host never waits for a copy except in ``wait``/``close``.
    """

    def __init__(self, worker: TransferWorker) -> None:
        self._device = worker.tensors[0].device
        self._tensors = worker.tensors
        self._layout = worker.layout
        self._host = worker.region.as_torch(padded=True)
        self._pinned = _host_register(worker.region)
        self._stream = torch.cuda.Stream(device=self._device)
        self._jobs: deque[_CudaJob] = deque()

    def submit(self, batch: Batch) -> None:
        job = _CudaJob(
            batch,
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
            [],
        )
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            job.start.record(self._stream)
            try:
                for seg in batch.segments:
                    job.keep.extend(self._enqueue(batch.direction, seg))
            except Exception as exc:  # reported as success=False
                job.error = repr(exc)
            finally:
                job.end.record(self._stream)
        self._jobs.append(job)

    def _to_device(self, ids: IntArray) -> torch.Tensor:
        pinned = torch.from_numpy(ids).pin_memory()
        return pinned.to(self._device, non_blocking=True)

    def _enqueue(self, direction: Direction, seg: Segment) -> list[torch.Tensor]:
        """Queue one segment's copies on the current (copy) stream."""
        index = self._to_device(seg.engine_ids)
        staging = torch.empty(
            (seg.engine_ids.size, self._host.shape[1]),
            dtype=torch.uint8,
            device=self._device,
        )
        members = zip(self._layout.groups[seg.group], self._layout.offsets[seg.group], strict=True)
        rows = np.arange(seg.slot_ids.size, dtype=np.int64)
        runs = coalesce_runs(rows, seg.slot_ids)
        if direction == "store":
            for t, off in members:
                page = self._layout.page_bytes[t]
                staging[:, off : off + page] = self._tensors[t].index_select(0, index)
            for row, slot, n in runs:
                self._host[slot : slot + n].copy_(staging[row : row + n], non_blocking=True)
        else:
            for row, slot, n in runs:
                staging[row : row + n].copy_(self._host[slot : slot + n], non_blocking=True)
            for t, off in members:
                page = self._layout.page_bytes[t]
                self._tensors[t].index_copy_(0, index, staging[:, off : off + page])
        return [index, staging]

    def _finished(self, job: _CudaJob) -> bool:
        try:
            return bool(job.end.query())
        except RuntimeError as exc:
            job.error = job.error or repr(exc)
            return True

    def poll(self) -> list[TransferResult]:
        results = []
        while self._jobs and self._finished(self._jobs[0]):
            results.append(self._jobs.popleft().result())
        return results

    def wait(self, job_ids: set[int]) -> None:
        for job in list(self._jobs):
            if job.batch.job_id in job_ids:
                try:
                    job.end.synchronize()
                except RuntimeError as exc:
                    job.error = job.error or repr(exc)

    def close(self) -> None:
        self.wait({job.batch.job_id for job in self._jobs})
        self._jobs.clear()
        if self._pinned is not None:
            _host_unregister(self._pinned)
            self._pinned = None
