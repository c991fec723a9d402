"""kvtier's Prometheus metrics, published through vLLM's offloading stats.

Two sets, side by side: kvtier's own (``vllm:kvtier_*``: hits, stores, tiers...)
and the ones vLLM's CPU offloading defines (``vllm:kv_offload_*``: stores
skipped, CPU cache usage gauges, allocation sizes), under vLLM's names, so
dashboards and alerts written for vLLM's offloading keep working. vLLM's
transfer metrics (bytes, time and size per direction) come from the worker's
transfer results; ``KVTierSpec`` is registered as a CPU offloading spec so
vLLM also fills the per-direction ``vllm:kv_offload_total_bytes`` family.
"""

from __future__ import annotations

from typing import Any

from kvtier.events import DEFAULT_MAX_EVENTS
from kvtier.tiers.base import DEFAULT_MAX_TIER_EVENTS
from kvtier.tiers.disk_lookups import DEFAULT_LOOKUP_TIMEOUT_S

METRIC_PREFIX = "vllm:kvtier_"

COUNTERS = {
    "hits": "Blocks found in kvtier's CPU tier, once per request (a request asking "
            "again while it waits is not counted again).",
    "misses": "Blocks asked for and not found in kvtier's CPU tier, once per request.",
    "stores": "Blocks stored into kvtier's CPU tier.",
    "evictions": "Blocks evicted from kvtier's CPU tier.",
    "stores_skipped": "Store candidates declined, each once per request: by the offer "
                      "count (store_threshold; vllm:kv_offload_stores_skipped counts "
                      "these alone) and by the adaptive policy's admission (new blocks "
                      "its history does not know, while vllm:kvtier_policy_admission "
                      "is 1).",
    "allocation_failures": "Store offers, and promotions from a lower tier, refused because "
                           "no CPU slot could be freed.",
    "events_dropped": "KV cache events of the CPU tier (each: blocks stored or removed "
                      f"together) dropped, oldest first, because {DEFAULT_MAX_EVENTS:,} "
                      "were pending "
                      "(nobody took them).",
}
"""Counter name (after the prefix) -> help text; values are manager.stats() fields."""

TIER_COUNTERS = {
    "promotions": "Block promotions from the disk/Redis tiers into CPU slots handed to "
                  "the I/O threads (a batch the read queue refused counts in "
                  "promotions_deferred instead).",
    "promotion_failures": "Promotions that failed (miss, corrupt, I/O error, timeout).",
    "promotion_timeouts": "Blocks whose promotion ran past promotion_timeout_s (a request "
                          "that asked for one meanwhile computed it instead).",
    "promotions_deferred": "Lower-tier hits not promoted because the read queue was full.",
    "promotions_stalled": "Lookups that passed a tier by: one of its reads or writes ran "
                          "past promotion_timeout_s, or every I/O thread's call did (no "
                          "new promotions until it returns).",
    "probes": "Keys whose presence in Redis was checked in a batch (asynchronous lookups).",
    "probes_deferred": "Keys whose presence check in Redis was not sent because the read "
                       "queue was full (answered as not found: misses).",
    "cascade_writes": "Blocks written from CPU slots to the disk/Redis tiers.",
    "duplicate_writes_skipped": "Block writes skipped because the tier held the block.",
    "writes_not_admitted": "Block writes refused by a tier's admission (*_store_threshold).",
    "write_failures": "Block writes a tier refused or failed (full, I/O error, down).",
    "dropped_writes": "Block writes to the disk/Redis tiers dropped (queue full, tier down).",
}
"""Counters of ``TierCascade.stats()``, reported when disk/Redis tiers are configured."""

PER_TIER_COUNTERS = {
    "hits": "Blocks read from this tier (promotions that found their block).",
    "misses": "Blocks asked of this tier and not found.",
    "stores": "Blocks written to this tier.",
    "dropped_stores": "Blocks this tier dropped (no room, ENOSPC, server down).",
    "corrupt": "Values that failed their checksum or header check and were removed.",
    "corrupt_kept": "Values that failed their check but stayed (Redis: the delete was "
                    "refused or failed); misses, counted again at each read.",
    "evictions": "Blocks this tier evicted itself (disk; Redis evicts server-side).",
    "errors": "I/O or server failures.",
    "breaker_opens": "Times the tier's circuit breaker opened (Redis). An opening whose "
                     "probe closed it again within reset_timeout_s (1 s by default) may "
                     "fall between two scrapes of vllm:kvtier_tier_available; this counts it.",
    "lookup_timeouts": "Disk lookups of blocks other engines wrote that got no answer "
                       f"within {DEFAULT_LOOKUP_TIMEOUT_S} s (disk_lookups=thread): misses.",
    "read_ms": "Milliseconds I/O threads spent reading this tier (promotions); "
               "divided by tier_hits + tier_misses: the read latency per block.",
    "write_ms": "Milliseconds I/O threads spent writing to this tier.",
    "events_dropped": "This tier's KV cache events (each: blocks stored or removed "
                      "together) dropped, oldest first, while as many were pending as "
                      f"the tier keeps ({DEFAULT_MAX_TIER_EVENTS:,} by default; nobody "
                      "took them).",
}
"""Counters of each tier's ``stats()``, labelled ``tier`` (``disk``, ``redis``)."""

TIER_LABELS = ("tier",)

POLICY_COUNTERS = {
    "policy_switches": "Times the adaptive policy's shadows switched it to another "
                       "configuration (a cache reset, which puts it back to its first "
                       "one, is not counted).",
}
"""Counters of the eviction policy (``manager.stats()``'s ``policy_*`` fields), reported
when the policy has them."""

TRACE_COUNTERS = {
    "trace_recorded": "Finished requests written to the trace file (trace_path).",
    "trace_dropped": "Finished requests left out of the trace because its writer "
                     "fell behind (its queue full).",
}
"""Counters of the trace recorder, reported while one records (``trace_path``)."""

POLICY_GAUGES = {
    "policy_history_factor": "The adaptive policy's frequency history, in multiples of "
                             "the capacity.",
    "policy_admission": "1 while the adaptive policy declines new blocks the history "
                        "does not know (admission on), else 0.",
    "policy_admission_evidence": "The adaptive policy's evidence on admission, measured on "
                                 "the cache while admission is off: hits it would have "
                                 "kept minus hits it would have lost, decayed (above 0: "
                                 "for admission).",
    "policy_recency": "1 while the adaptive policy runs the cache as LRU (its LRU shadow "
                      "led), else 0.",
}
"""Gauges of the eviction policy, reported when the policy has them."""

GAUGES = {
    "resident": "Blocks held in kvtier's CPU tier.",
    "pinned": "Resident blocks being read: by a load to the engine, or by a write "
              "to the disk/Redis tiers.",
    "leased": "Resident blocks leased to requests between lookup and load.",
    "write_pending": "Resident blocks whose store is in flight.",
    "usage_ratio": "Fraction of kvtier's CPU slots in use.",
}


def metric_definitions(extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metric metadata vLLM registers with Prometheus for KVTierSpec:
    vLLM's CPU offloading metrics (its own definitions) and kvtier's."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    defs: dict[str, Any] = dict(CPUOffloadingSpec.build_metric_definitions(
        dict(extra_config or {})))
    defs.update({
        METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=doc)
        for name, doc in {**COUNTERS, **TIER_COUNTERS, **POLICY_COUNTERS,
                          **TRACE_COUNTERS}.items()
    })
    defs.update(
        {METRIC_PREFIX + name: OffloadingGaugeMetadata(documentation=doc)
         for name, doc in {**GAUGES, **POLICY_GAUGES}.items()}
    )
    defs.update(
        {METRIC_PREFIX + "tier_" + name: OffloadingCounterMetadata(
            documentation=doc, labelnames=TIER_LABELS)
         for name, doc in PER_TIER_COUNTERS.items()}
    )
    defs[METRIC_PREFIX + "tier_available"] = OffloadingGaugeMetadata(
        documentation=("1 while the tier serves, 0 from its circuit breaker's opening until "
                       "a probe succeeds (also while no call comes to probe)."),
        labelnames=TIER_LABELS)
    return defs


def fill_stats(
    stats: dict[str, int],
    num_blocks: int,
    reported: dict[str, int],
    tiers: dict[str, dict[str, Any]] | None = None,
    allocation_sizes: list[int] | None = None,
    store_threshold: int = 1,
) -> Any:
    """vLLM stats for the interval since the last call; ``reported`` keeps counter
    totals (one entry per metric and tier). ``tiers``: each lower tier's
    ``stats()`` plus ``available``, by tier name. ``allocation_sizes``: slots
    granted by each store offer since the last call (emptied here)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    out = OffloadingConnectorStats()
    _vllm_cpu_stats(out, stats, num_blocks, reported, allocation_sizes or [], store_threshold)
    for name in (*COUNTERS, *(n for n in (*TIER_COUNTERS, *TRACE_COUNTERS) if n in stats)):
        _count(out, reported, name, stats[name])
    for name in (n for n in POLICY_COUNTERS if n in stats):
        _count(out, reported, name, stats[name], restarts=True)
    for name in ("resident", "pinned", "leased", "write_pending",
                 *(n for n in POLICY_GAUGES if n in stats)):
        out.set_gauge(METRIC_PREFIX + name, stats[name])
    out.set_gauge(METRIC_PREFIX + "usage_ratio", stats["resident"] / num_blocks)
    for tier, tier_stats in (tiers or {}).items():
        for name in PER_TIER_COUNTERS:
            value = tier_stats.get(name)
            if isinstance(value, int):
                _count(out, reported, "tier_" + name, value, tier)
        out.set_gauge(METRIC_PREFIX + "tier_available",
                      1 if tier_stats.get("available", True) else 0, (tier,))
    return out


def _vllm_cpu_stats(out: Any, stats: dict[str, int], num_blocks: int,
                    reported: dict[str, int], allocation_sizes: list[int],
                    store_threshold: int) -> None:
    """vLLM's CPU offloading metrics, as its ``CPUOffloadingManager`` reports them:
    usage = blocks that cannot be evicted now (written, loaded, leased) over
    all blocks; write usage = blocks being written; read usage = the rest."""
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

    usage = stats["unevictable"] / num_blocks
    write = stats["write_pending"] / num_blocks
    out.set_gauge(M.CPU_CACHE_USAGE_PERC, usage)
    out.set_gauge(M.CPU_CACHE_WRITE_USAGE_PERC, write)
    out.set_gauge(M.CPU_CACHE_READ_USAGE_PERC, max(usage - write, 0.0))
    for size in allocation_sizes:
        out.observe_histogram(M.CPU_ALLOCATION_SIZE, size)
    allocation_sizes.clear()
    if store_threshold >= 2:  # vLLM's: "reuse threshold not reached", not the policy's
        _count(out, reported, "stores_below_threshold", stats["stores_below_threshold"],
               metric=M.STORES_SKIPPED)


def _count(out: Any, reported: dict[str, int], name: str, total: int, tier: str = "",
           metric: str | None = None, restarts: bool = False) -> None:
    """Report the increase of counter ``name`` (of ``tier``) since the last call,
    as ``metric`` (default: kvtier's name for it).

    kvtier's own totals never decrease (a cache reset keeps them), so the
    increase is exact. ``restarts``: the total belongs to a part that may
    start it again from 0 (a plug-in policy's ``switches`` at ``clear()``):
    a total below the last one is then all new, as Prometheus reads a
    counter reset (what came between the last report and the restart is
    lost, so kvtier's own parts do not restart). Otherwise a lower total is
    not reported.

    The first report of a counter is sent even at 0: vLLM creates a labelled
    Prometheus series only when it is first increased, and a series that
    appears at its first error count (``tier_errors`` at 5) shows no
    ``increase()`` or ``rate()``, so an alert on it would miss the first outage."""
    metric = metric or METRIC_PREFIX + name
    slot = f"{metric}|{tier}"
    first = slot not in reported
    last = reported.get(slot, 0)
    if total < last and not restarts:
        return  # the last total stays the baseline: a rise back to it is not new
    delta = total - last if total >= last else total
    reported[slot] = total
    if delta > 0 or first:
        labels = (tier,) if tier else ()
        out.increase_counter(metric, delta, labels)
