"""A tier below the CPU tier as the cascade holds it: the tier and its
write policy, admission threshold and existence probes (:class:`LowerTier`),
shared by the cascade (:mod:`kvtier.tiers.cascade`) and its writes
(:mod:`kvtier.tiers.cascade_writes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.tiers.base import Tier
from kvtier.tiers.probes import ExistenceProbes

WritePolicy = Literal["store", "evict"]
"""When a block is written to a lower tier: when the CPU tier stores it
(write-through) or when the CPU tier evicts it."""
WRITE_POLICIES: tuple[WritePolicy, ...] = ("store", "evict")


@dataclass(slots=True)
class LowerTier:
    """One tier below the CPU tier with its cascade settings."""

    tier: Tier
    write: WritePolicy
    threshold: int
    probes: ExistenceProbes | None  # remote tiers asked asynchronously
