"""The memory a replay command's sizes ask for, checked before the run starts
(``kvtier replay``, ``kvtier soak``, ``kvtier foresight``): a ``--capacity``
this process cannot hold fails at once, naming the flag, not after the
trace has loaded."""

from __future__ import annotations

from kvtier.errors import CommandError

MANAGER_BYTES_PER_SLOT = 40
"""Memory a manager takes per CPU slot before it holds a block (its free-slot
list, measured with tracemalloc): the least a ``--capacity`` costs."""
ENGINE_CACHE_BYTES_PER_BLOCK = 139
"""Memory the model of vLLM's prefix cache takes per ``--gpu-blocks`` block (measured)."""


def check_sizes_fit(capacity: int | None = None, gpu_blocks: int | None = None,
                    capacity_flag: str = "--capacity") -> None:
    """``CommandError`` naming the flag when ``capacity`` CPU slots or
    ``gpu_blocks`` engine cache blocks ask for more memory than this process
    may use: found before a run (replay, soak, foresight) starts."""
    from kvtier.host_memory import check_fits

    try:
        if capacity is not None:
            check_fits(capacity_flag, capacity, MANAGER_BYTES_PER_SLOT, "CPU slots")
        if gpu_blocks is not None:
            check_fits("--gpu-blocks", gpu_blocks, ENGINE_CACHE_BYTES_PER_BLOCK,
                       "engine cache blocks")
    except ValueError as exc:
        raise CommandError(str(exc)) from None
