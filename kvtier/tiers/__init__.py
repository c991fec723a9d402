"""Secondary tiers below the CPU slots: local disk and Redis/Valkey (DESIGN.md §7).

Both store the same checksummed values (:mod:`kvtier.tiers.blockfile`) under a
namespace (:mod:`kvtier.tiers.namespace`) and implement one batch interface,
:class:`~kvtier.tiers.base.Tier`, which the tier cascade drives::

    from kvtier.tiers import DiskTier, KVLayout, RedisTier
    ns = KVLayout("my-model", "bfloat16", 16, 32, 8, 128).namespace(tenant_salt=None)
    disk = DiskTier("/var/cache/kvtier", ns, capacity_bytes=200 << 30)
    disk.put([(key, region.slot_array(slot))])
    lengths = disk.get_into([key], [region.slot_array(other_slot)])

:class:`~kvtier.tiers.cascade.TierCascade` puts them under an ``OffloadManager``
(lookups that promote, per-tier write policy and admission).

``RedisTier`` needs the ``redis`` extra (redis-py); it is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.tiers.base import (
    COUNTERS,
    Tier,
    TierConfigError,
    TierEvent,
    TierUnavailableError,
)
from kvtier.tiers.blockfile import CorruptBlockError
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.namespace import KVLayout, check_namespace, namespace_of

if TYPE_CHECKING:
    from kvtier.tiers.redis_tier import RedisTier

__all__ = [
    "COUNTERS",
    "CircuitBreaker",
    "CorruptBlockError",
    "DiskTier",
    "KVLayout",
    "RedisTier",
    "Tier",
    "TierCascade",
    "TierConfigError",
    "TierEvent",
    "TierUnavailableError",
    "check_namespace",
    "namespace_of",
]


def __getattr__(name: str) -> Any:
    if name == "RedisTier":
        from kvtier.tiers.redis_tier import RedisTier

        return RedisTier
    raise AttributeError(f"module 'kvtier.tiers' has no attribute {name!r}")
