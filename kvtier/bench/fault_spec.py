"""A slow disk for the fault drills: ``KVTierSpec`` whose disk tier waits before
every read and write while a control file says so.

A real disk cannot be made slow on demand, so this wraps the real ``DiskTier``
(the bytes still come from it). Selected with ``"spec_name": "SlowDiskSpec",
"spec_module_path": "kvtier.bench.fault_spec"``; the environment variable
``KVTIER_FAULT_CONTROL`` names a file holding the delay in seconds (absent or
empty: no delay), so a drill can start and stop the fault while a server runs.
Never for production.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from kvtier.bench.faults import CONTROL_ENV
from kvtier.tiers.base import Tier
from kvtier.tiers.blockfile import BytesLike
from kvtier.tiers.delegating import DelegatingTier
from kvtier.vllm.spec import KVTierSpec


def control_delay(path: str | None) -> float:
    """The delay the control file asks for (0.0 when none)."""
    if not path:
        return 0.0
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return 0.0
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        return 0.0


class SlowTier(DelegatingTier):
    """Waits ``control_delay(control)`` seconds before each read and write."""

    def __init__(self, inner: Tier, control: str | None) -> None:
        super().__init__(inner)
        self.control = control

    def _wait(self) -> None:
        delay = control_delay(self.control)
        if delay:
            time.sleep(delay)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self._wait()
        return super().get_into(keys, buffers)

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        self._wait()
        return super().put(items)


class SlowDiskSpec(KVTierSpec):
    """``KVTierSpec`` whose disk tier is a ``SlowTier``."""

    def _disk_tier(self, rank: int) -> Tier:
        return SlowTier(super()._disk_tier(rank), os.environ.get(CONTROL_ENV))
