"""Batched block copies between an engine's KV tensors and CPU slots.

The engine's KV cache is a list of *canonical tensors*, each viewed as
``(num_blocks, page_bytes)`` bytes. One offloaded block of KV group ``g`` is the
concatenation of that block's page in every tensor of group ``g``; it is stored
in one slot of a :class:`~kvtier.slots.region.SlotRegion`.

On CPU the copies are plain memory copies done by numpy (which releases the
GIL), optionally on a few threads. The CUDA backend lives in
:mod:`kvtier.slots.cuda`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.slots.jobs import (
    CUDA_COPY_MODES,
    Batch,
    CudaCopy,
    Direction,
    IntArray,
    Segment,
    TransferResult,
    U8Array,
    coalesce_runs,
)
from kvtier.slots.layout import SlotLayout
from kvtier.slots.region import SlotRegion

logger = logging.getLogger(__name__)


# Pages at least this large are copied run by run (consecutive ids coalesced);
# smaller pages are gathered and scattered with one fancy-indexed copy per
# tensor, which costs two passes but far fewer Python calls.
ROW_COPY_MIN_BYTES = 16 * 1024
# Smaller jobs are copied by the calling thread alone: handing them to the copy
# pool costs more than it saves.
PARALLEL_MIN_BYTES = 8 * 1024 * 1024


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
    # Always a copy: an asynchronous job reads its ids after submit returned,
    # and a caller reusing its id buffer must not change which blocks it moves.
    return ids.astype(np.int64, copy=True)


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
    a copy error, a job after ``shutdown``) is reported with ``success=False``
    and never raises. Memory: one result (and, until it ran, one batch of ids)
    per job submitted and not yet returned by ``get_finished``; the engine
    polls every step, which bounds them by the jobs of a few steps.
    """

    def __init__(
        self,
        kv_tensors: Sequence[torch.Tensor],
        region: SlotRegion,
        *,
        groups: Sequence[Sequence[int]] | None = None,
        copy_threads: int = 1,
        asynchronous: bool = False,
        cuda_copy: CudaCopy = "auto",
    ) -> None:
        """``groups[g]`` lists the tensor indices of KV group ``g`` (default: all
        tensors form group 0). On CPU, ``copy_threads`` threads share each copy
        and ``asynchronous`` runs jobs in order on a background thread. On CUDA,
        ``cuda_copy`` picks how bytes cross to the slots (``kvtier.slots.cuda``)."""
        if not kv_tensors:
            raise ValueError("TransferWorker needs at least one KV tensor")
        if cuda_copy not in CUDA_COPY_MODES:  # checked on CPU too: a config error either way
            raise ValueError(f"cuda_copy must be one of {CUDA_COPY_MODES}, got {cuda_copy!r}")
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
        self._copier = self._make_copier(copy_threads, asynchronous, cuda_copy)
        self._closed = False

    @staticmethod
    def _common_num_blocks(tensors: Sequence[torch.Tensor]) -> int:
        counts = {int(t.shape[0]) for t in tensors}
        if len(counts) != 1:
            raise ValueError(f"KV tensors disagree on num_blocks: {sorted(counts)}")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"KV tensors live on several devices: {devices}")
        return counts.pop()

    def _make_copier(self, copy_threads: int, asynchronous: bool, cuda_copy: CudaCopy) -> _Copier:
        device = self.tensors[0].device
        if device.type == "cpu":
            return CpuCopier(self, copy_threads, asynchronous)
        if device.type == "cuda" and torch.cuda.is_available():
            from kvtier.slots.cuda import CudaCopier

            return CudaCopier(self.tensors, self.layout, self.region, cuda_copy)
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
            if self._closed:
                # its resources are released (the region closed, unpinned): never a success
                raise RuntimeError("transfer worker is shut down")
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
        """Finish in-flight jobs and release backend resources; jobs submitted
        afterwards fail (``success=False``) without copying."""
        self._closed = True
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
        return [_CopyTask(self.dst, self.dst_ids[a:b], self.src, self.src_ids[a:b])
                for a, b in _shares(self.src_ids.size, parts)]


@dataclass(frozen=True)
class _ZeroTask:
    """A store's slots past its group's pages: ``tail[ids] = 0``, so that a
    slot never carries the bytes of the block it held before (a larger
    group's) down to the tiers, as the CUDA path's zeroed staging does."""

    tail: U8Array
    ids: IntArray

    def run(self) -> None:
        self.tail[self.ids] = 0

    def split(self, parts: int) -> list[_ZeroTask]:
        return [_ZeroTask(self.tail, self.ids[a:b]) for a, b in _shares(self.ids.size, parts)]


def _shares(size: int, parts: int) -> list[tuple[int, int]]:
    """``[a, b)`` bounds of ``parts`` near-equal, non-empty shares of ``size`` items."""
    bounds = np.linspace(0, size, parts + 1).astype(int).tolist()
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


class CpuCopier:
    """CPU backend: numpy copies between engine tensors and slot columns.

    Owns numpy views of the engine tensors and region, an optional pool of copy
    threads, and an optional single background thread that runs jobs in
    submission order. Results are kept in submission order, one per job not
    yet polled (the worker's bound).
    """

    def __init__(self, worker: TransferWorker, copy_threads: int, asynchronous: bool):
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self._engine = [t.numpy() for t in worker.tensors]
        self._groups = worker.layout.groups
        slots = worker.region.as_numpy()
        self._columns = self._slot_columns(worker.layout, slots)
        self._tails = [slots[:, worker.layout.group_bytes(g):] if
                       worker.layout.group_bytes(g) < slots.shape[1] else None
                       for g in range(len(worker.layout.groups))]
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

    def tasks(self, batch: Batch) -> list[_CopyTask | _ZeroTask]:
        """One copy task per (segment, tensor) of the batch, and for a store of
        a group smaller than the slot, one that zeroes the rest of its slots."""
        tasks: list[_CopyTask | _ZeroTask] = []
        store = batch.direction == "store"
        for seg in batch.segments:
            members = zip(self._groups[seg.group], self._columns[seg.group], strict=True)
            for t, column in members:
                engine = self._engine[t]
                if store:
                    tasks.append(_CopyTask(column, seg.slot_ids, engine, seg.engine_ids))
                else:
                    tasks.append(_CopyTask(engine, seg.engine_ids, column, seg.slot_ids))
            tail = self._tails[seg.group]
            if store and tail is not None:
                tasks.append(_ZeroTask(tail, seg.slot_ids))
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

    def _run_parallel(self, tasks: list[_CopyTask | _ZeroTask]) -> None:
        if self._pool is None:
            raise RuntimeError("no copy pool")
        if len(tasks) < self._threads:
            tasks = [part for task in tasks for part in task.split(self._threads)]
        shards = [tasks[i :: self._threads] for i in range(self._threads)]
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


def _run_all(tasks: Sequence[_CopyTask | _ZeroTask]) -> None:
    for task in tasks:
        task.run()
