"""Wrong KV bytes on demand: the negative controls of the end-to-end tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.demo import engine as E

if TYPE_CHECKING:
    from vllm import LLM


def corrupt_region(llm: LLM) -> None:
    """Zero every slot of the engine's kvtier region, from this process."""
    from kvtier.slots.region import SlotRegion

    region = SlotRegion.attach(E.region_path(llm))
    try:
        region.as_numpy()[:] = 0
    finally:
        region.close()
