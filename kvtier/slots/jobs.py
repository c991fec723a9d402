"""What one copy job is: its validated batch of segments, and its result.

Shared by the worker and its CPU and CUDA copy backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

Direction = Literal["store", "load"]
IntArray = npt.NDArray[np.int64]
U8Array = npt.NDArray[np.uint8]

CudaCopy = Literal["auto", "mapped", "memcpy"]
CUDA_COPY_MODES: tuple[CudaCopy, ...] = ("auto", "mapped", "memcpy")
"""How the CUDA backend moves bytes to and from the slots (``kvtier.slots.cuda``)."""


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one store or load job."""

    job_id: int
    success: bool
    num_bytes: int = 0
    seconds: float | None = None
    error: str | None = None


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
