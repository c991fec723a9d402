"""Block payloads and file sizes shared by the disk tier's review tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import block_key
from kvtier.tiers import DiskTier, blockfile
from kvtier.tiers.disk_dir import allocated

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
