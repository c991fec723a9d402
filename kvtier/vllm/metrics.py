"""kvtier's Prometheus metrics, published through vLLM's offloading stats."""

from __future__ import annotations

from typing import Any

METRIC_PREFIX = "vllm:kvtier_"

COUNTERS = {
    "hits": "Block lookups answered from kvtier's CPU tier.",
    "misses": "Block lookups kvtier could not answer.",
    "stores": "Blocks stored into kvtier's CPU tier.",
    "evictions": "Blocks evicted from kvtier's CPU tier.",
    "stores_skipped": "Store candidates refused by admission (store_threshold).",
    "allocation_failures": "Store offers refused because no slot could be freed.",
}
"""Counter name (after the prefix) -> help text; values are manager.stats() fields."""

TIER_COUNTERS = {
    "promotions": "Block promotions from the disk/Redis tiers into CPU slots started.",
    "promotion_failures": "Promotions that failed (miss, corrupt, I/O error, timeout).",
    "cascade_writes": "Blocks written from CPU slots to the disk/Redis tiers.",
    "dropped_writes": "Block writes to the disk/Redis tiers dropped (queue full, tier down).",
}
"""Counters of ``TierCascade.stats()``, reported when disk/Redis tiers are configured."""

GAUGES = {
    "resident": "Blocks held in kvtier's CPU tier.",
    "pinned": "Resident blocks being read by a load.",
    "leased": "Resident blocks leased to requests between lookup and load.",
    "write_pending": "Resident blocks whose store is in flight.",
    "usage_ratio": "Fraction of kvtier's CPU slots in use.",
}


def metric_definitions() -> dict[str, Any]:
    """The metric metadata vLLM registers with Prometheus for KVTierSpec."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    defs: dict[str, Any] = {
        METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=doc)
        for name, doc in {**COUNTERS, **TIER_COUNTERS}.items()
    }
    defs.update(
        {METRIC_PREFIX + name: OffloadingGaugeMetadata(documentation=doc)
         for name, doc in GAUGES.items()}
    )
    return defs


def fill_stats(stats: dict[str, int], num_blocks: int, reported: dict[str, int]) -> Any:
    """vLLM stats for the interval since the last call; ``reported`` keeps counter totals."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    out = OffloadingConnectorStats()
    for name in (*COUNTERS, *(n for n in TIER_COUNTERS if n in stats)):
        delta = stats[name] - reported.get(name, 0)
        reported[name] = stats[name]
        if delta > 0:
            out.increase_counter(METRIC_PREFIX + name, delta)
    for name in ("resident", "pinned", "leased", "write_pending"):
        out.set_gauge(METRIC_PREFIX + name, stats[name])
    out.set_gauge(METRIC_PREFIX + "usage_ratio", stats["resident"] / num_blocks)
    return out
