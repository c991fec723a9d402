"""Block payloads, file sizes, disk tiers and ranked tiers shared by the disk
tier's tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import block_key
from kvtier.slots import SlotRegion
from kvtier.tiers import DiskTier, KVLayout, blockfile
from kvtier.tiers.disk_dir import allocated
from kvtier.tiers.ranks import RankedTier, RankRegions

SIZE = 16 * 1024
"""Bytes of one test block's payload."""
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")


def payload(i: int, size: int = SIZE) -> np.ndarray:
    """Block ``i``'s payload: ``size`` bytes, the same for the same ``i``."""
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def file_bytes(ns: str, size: int = SIZE) -> int:
    """The disk space one block file of ``size`` payload bytes takes in ``ns``."""
    return allocated(blockfile.header_size(ns.encode(), block_key(0)) + size)


def make_disk(path: Path, ns: str, capacity: int = 64 << 20, **kw: Any) -> DiskTier:
    """A disk tier for a test: no free-space reserve and inline lookups unless
    ``kw`` says otherwise."""
    kw.setdefault("free_reserve_bytes", 0)
    kw.setdefault("lookups", "inline")
    return DiskTier(path, ns, capacity, **kw)


def ranked_disks(make: Callable[..., DiskTier], path: Path, model: str,
                 ranks: int = 2) -> tuple[RankedTier, list[DiskTier]]:
    """A ranked tier over ``ranks`` disk tiers at ``path``, one per
    tensor-parallel rank of ``model``, each made by ``make(path, ns=...)``."""
    tiers = [make(path, ns=KVLayout(model, "bfloat16", 16, 2, 2, 64,
                                    tp_rank=r, tp_size=ranks).namespace())
             for r in range(ranks)]
    return RankedTier(tiers), tiers


def rank_regions(shm_dir: Path, prefix: str, ranks: int = 2) -> Iterator[RankRegions]:
    """A fixture's body: one slot region per rank (4 slots of ``SIZE`` bytes,
    named ``prefix-RANK``), closed after the test."""
    made = [SlotRegion.create(f"{prefix}-{r}", 4, SIZE, shm_dir=shm_dir) for r in range(ranks)]
    yield RankRegions(made)
    for region in made:
        region.close()
