"""The CUDA backend of :class:`~kvtier.slots.worker.TransferWorker`.

The region's slots are registered as pinned, mapped host memory; copies run
on a dedicated stream, ordered after the work already queued on the engine's
stream, and are tracked with events, so the engine's thread never waits.

Two ways to move a segment's bytes between the GPU staging buffer and the
slots, chosen per segment (``cuda_copy``):

* ``memcpy``: one ``cudaMemcpyAsync`` per run of consecutive slot ids, done by
  the copy engines, which leaves the SMs to the engine. Each run costs the
  host 10-20 us to queue, so runs smaller than what the link moves in that
  time leave the copy engines idle.
* ``mapped``: one gather or scatter kernel that reads or writes the slots
  through their device address (the region is mapped into the GPU's address
  space): a few launches per segment whatever the number of runs, but the
  kernel takes SM time from the engine's work while it runs.

``auto`` (:func:`pick_copy`) takes ``mapped`` only for segments of many small
runs, where memcpy cannot keep the link busy. Measured on an H200 (docs/costs.md,
"Copy bandwidth"): 256 scattered 64 KiB blocks moved at 4.4 GB/s by memcpy and
16 GB/s mapped, 256 scattered 2 MiB blocks at 46 and 47 GB/s; a mapped copy
slowed matrix products running beside it by a quarter, a memcpy one not at all.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.slots.jobs import (
    Batch,
    CudaCopy,
    Direction,
    IntArray,
    Segment,
    TransferResult,
    coalesce_runs,
)
from kvtier.slots.layout import SlotLayout
from kvtier.slots.region import SlotRegion

logger = logging.getLogger(__name__)

MEMCPY_MAX_RUNS = 8
"""``auto`` copies a segment of at most this many runs with memcpy, whatever
their size: queueing them costs the host little."""
MEMCPY_MIN_RUN_BYTES = 1 << 20
"""``auto`` copies a segment of more runs with memcpy when its runs average at
least this many bytes: about what a PCIe 5 link moves (50 GB/s) in the 10-20 us
the host takes to queue one copy, so the copy engines stay busy."""

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_CUDA_HOST_MEMORY_ALREADY_REGISTERED = 712


def pick_copy(mode: CudaCopy, runs: int, segment_bytes: int, mapped: bool) -> CudaCopy:
    """How to move one segment of ``runs`` runs and ``segment_bytes`` bytes:
    ``"memcpy"`` or ``"mapped"`` (only when the region is ``mapped``)."""
    if not mapped or mode == "memcpy":
        return "memcpy"
    if mode == "mapped":
        return "mapped"
    small = segment_bytes < MEMCPY_MIN_RUN_BYTES * runs
    return "mapped" if runs > MEMCPY_MAX_RUNS and small else "memcpy"


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


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (through torch), if any."""
    try:
        with open("/proc/self/maps") as maps:
            lib = next((ln.split()[-1] for ln in maps if "libcudart" in ln), None)
        return ctypes.CDLL(lib) if lib is not None else None
    except OSError:
        return None


def clear_cuda_error() -> None:
    """Reset CUDA's last-error state after a failed runtime call (best effort),
    so a later kernel-launch check does not report our error as its own."""
    lib = _cudart()
    try:
        if lib is not None:
            lib.cudaGetLastError()
    except AttributeError:
        logger.debug("kvtier: could not clear the CUDA error state")


def host_register(region: SlotRegion) -> int | None:
    """Pin and map the region's slots for the GPU; returns the address to
    unregister, or None when this worker did not register them (already
    registered, or failed)."""
    address, size = region.base_address(), region.slots_nbytes
    flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(address, size, flags))
    except (AttributeError, AssertionError, RuntimeError) as exc:
        logger.warning("kvtier: cannot pin slot region %s: %r", region.name, exc)
        return None
    if code == 0:
        return address
    clear_cuda_error()
    if code != _CUDA_HOST_MEMORY_ALREADY_REGISTERED:
        logger.warning(
            "kvtier: could not pin slot region %s (cudaError %d); copies to it "
            "are pageable and may block the engine",
            region.name,
            code,
        )
    return None


def host_unregister(address: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(address))
    if code != 0:
        clear_cuda_error()
        logger.warning("kvtier: cudaHostUnregister failed (cudaError %d)", code)


class _DeviceAlias:
    """A ``__cuda_array_interface__`` over the slots' device address."""

    def __init__(self, pointer: int, num_slots: int, stride: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_slots, stride // 8),
            "typestr": "<i8",
            "data": (pointer, False),
            "version": 3,
        }


def mapped_slots(region: SlotRegion, device: torch.device) -> torch.Tensor | None:
    """The padded slots as an int64 CUDA tensor aliasing the pinned host memory
    (kernels read and write the slots through it), or None when the region is
    not mapped into the GPU's address space."""
    lib = _cudart()
    pointer = ctypes.c_void_p()
    try:
        if lib is None or region.slot_stride % 8:
            return None
        host = ctypes.c_void_p(region.base_address())
        code = int(lib.cudaHostGetDevicePointer(ctypes.byref(pointer), host, 0))
    except AttributeError:
        return None
    if code != 0 or not pointer.value:
        clear_cuda_error()
        return None
    alias = _DeviceAlias(pointer.value, region.num_slots, region.slot_stride)
    try:
        with torch.cuda.device(device):
            return torch.as_tensor(alias, device=device)
    except (RuntimeError, TypeError, ValueError) as exc:
        clear_cuda_error()
        logger.info("kvtier: slot region %s cannot be mapped for the GPU: %r", region.name, exc)
        return None


class CudaCopier:
    """CUDA backend: copies on one dedicated stream, completion via events.

    Owns the copy stream, the in-flight jobs (with their staging buffers and
    index tensors, kept alive until the job's end event has completed), the
    pinned registration of the region's slots, undone by ``close()``, and the
    slots' device alias when the region is mapped.

    A store gathers the blocks' pages on the GPU into a staging buffer laid out
    like slots (the bytes past the group's pages zeroed, so no stale GPU
    memory reaches a slot), then moves it to the slots; a load does the
    reverse. Every job first waits for the work already queued on the engine's
    current stream, and jobs run in submission order. The host never waits
    for a copy except in ``wait``/``close``.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], layout: SlotLayout, region: SlotRegion,
                 cuda_copy: CudaCopy = "auto") -> None:
        self._device = tensors[0].device
        self._tensors = tensors
        self._layout = layout
        self._host = region.as_torch(padded=True)
        self._pinned = host_register(region)
        self._mapped = mapped_slots(region, self._device) if cuda_copy != "memcpy" else None
        if cuda_copy == "mapped" and self._mapped is None:
            if self._pinned is not None:
                host_unregister(self._pinned)
            raise RuntimeError(f"slot region {region.name} is not mapped for the GPU")
        self._mode = cuda_copy
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
        members = list(
            zip(self._layout.groups[seg.group], self._layout.offsets[seg.group], strict=True)
        )
        rows = np.arange(seg.slot_ids.size, dtype=np.int64)
        runs = coalesce_runs(rows, seg.slot_ids)
        seg_bytes = seg.slot_ids.size * self._layout.group_bytes(seg.group)
        how = pick_copy(self._mode, len(runs), seg_bytes, self._mapped is not None)
        mapped = self._mapped if how == "mapped" else None
        slot_index = self._to_device(seg.slot_ids) if mapped is not None else None
        if direction == "store":
            staging = self._gather(seg.group, index, members)
            if mapped is not None and slot_index is not None:
                mapped.index_copy_(0, slot_index, staging.view(torch.int64))
            else:
                for row, slot, n in runs:
                    self._host[slot : slot + n].copy_(staging[row : row + n], non_blocking=True)
        else:
            if mapped is not None and slot_index is not None:
                staging = mapped.index_select(0, slot_index).view(torch.uint8)
            else:
                staging = self._staging(seg.slot_ids.size)
                for row, slot, n in runs:
                    staging[row : row + n].copy_(self._host[slot : slot + n], non_blocking=True)
            for t, off in members:
                page = self._layout.page_bytes[t]
                self._tensors[t].index_copy_(0, index, staging[:, off : off + page])
        return [t for t in (index, slot_index, staging) if t is not None]

    def _staging(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self._host.shape[1]), dtype=torch.uint8, device=self._device)

    def _gather(
        self, group: int, index: torch.Tensor, members: list[tuple[int, int]]
    ) -> torch.Tensor:
        """The blocks' pages laid out like slots, zeros past the group's bytes."""
        staging = self._staging(int(index.numel()))
        for t, off in members:
            page = self._layout.page_bytes[t]
            staging[:, off : off + page] = self._tensors[t].index_select(0, index)
        staging[:, self._layout.group_bytes(group) :].zero_()
        return staging

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
        self._mapped = None
        if self._pinned is not None:
            host_unregister(self._pinned)
            self._pinned = None
