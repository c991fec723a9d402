"""CPU slot region in shared memory and the worker that fills it.

``SlotRegion`` holds KV bytes in fixed-size slots of a POSIX shared-memory file
(numpy only); ``TransferWorker`` copies blocks between an engine's KV tensors
and those slots (needs torch, imported on first use). Nothing here imports
vLLM; the vLLM adapter lives in ``kvtier.vllm.worker``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.slots.region import SlotRegion, cleanup_stale_regions, region_name

if TYPE_CHECKING:
    from kvtier.slots.worker import TransferResult, TransferWorker

__all__ = [
    "SlotRegion",
    "TransferResult",
    "TransferWorker",
    "cleanup_stale_regions",
    "region_name",
]


def __getattr__(name: str) -> Any:
    if name in ("TransferResult", "TransferWorker"):
        from kvtier.slots import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'kvtier.slots' has no attribute {name!r}")
