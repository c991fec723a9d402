"""Where a block's pages lie in a CPU slot: :class:`SlotLayout`, shared by the
CPU copies (:mod:`kvtier.slots.worker`) and the CUDA ones (:mod:`kvtier.slots.cuda`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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
