"""kvtier's metrics as vLLM 0.32 reads them, counters and their totals:
vLLM's own stores-skipped metric, the adaptive policy's switch counter across
a cache reset, promotions the I/O pool refused, the hit source of a promotion
whose tier was forgotten, and counters that were kept but never exported.
Real SlotRegions, disk tiers and redis-server; a gate wrapper only holds an
I/O thread in a real tier's read. No engine is started."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.gated_tier import Gate

from kvtier import OffloadManager
from kvtier.slots.region import SlotRegion
from kvtier.tiers import DiskTier, KVLayout, Tier

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm(-cpu)")

NS = KVLayout("m", "bfloat16", 16, 2, 2, 64).namespace()
SLOTS = 8
SIZE = 4096


def _key(i: int, group: int = 0) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(8, "big"), group)


def _counter(stats: Any, name: str, labels: tuple[str, ...] = ()) -> float:
    return float(stats.data["data"].get(name, {}).get(labels, 0))


def _disk(path: Path, **kwargs: Any) -> DiskTier:
    return DiskTier(path, NS, 64 << 20, free_reserve_bytes=0, **kwargs)


def _put(tier: Tier, ids: Sequence[int]) -> None:
    """Blocks ``ids`` written straight into ``tier`` (as another engine would)."""
    rng = np.random.default_rng(0)
    items = [(_key(i), rng.integers(0, 256, SIZE, dtype=np.uint8)) for i in ids]
    assert all(tier.put(items))




@pytest.fixture
def region(tmp_path: Path) -> Iterator[SlotRegion]:
    with SlotRegion.create("metrics-leftovers", SLOTS, SIZE, shm_dir=tmp_path) as r:
        yield r


def _settle(adapter: Any, keys: Sequence[Any], req: Any, timeout_s: float = 10.0) -> None:
    """Ask for ``keys`` step after step, as vLLM does, until each is a HIT."""
    from vllm.v1.kv_offload.base import LookupResult

    deadline = time.monotonic() + timeout_s
    while True:
        results = [adapter.lookup(k, req) for k in keys]
        if all(r is LookupResult.HIT for r in results):
            return
        assert LookupResult.MISS not in results, results
        assert time.monotonic() < deadline, results
        adapter.on_schedule_end(None)
        time.sleep(0.005)


# ------------------------------------------------------------ (1) stores skipped
def test_vllms_stores_skipped_counts_only_the_threshold_not_the_policy() -> None:
    """vLLM defines ``vllm:kv_offload_stores_skipped`` as "stores skipped
    because the reuse threshold was not reached". kvtier fed it its own
    ``stores_skipped``, which also counts the adaptive policy's admission
    declines, so a policy decline read as a threshold skip."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.vllm.adapter import KVTierOffloadingManager

    adapter = KVTierOffloadingManager(OffloadManager(4, policy="default", store_threshold=2))
    policy = adapter.manager.policy

    def offer(name: str, keys: list[Any], finish: bool = True) -> list[Any]:
        req = ReqContext(req_id=name)
        adapter.on_new_request(req)
        for i, key in enumerate(keys):
            req.set_offload_key_position(key, 16 * (i + 1))
        out = adapter.prepare_store(keys, req)
        assert out is not None
        if out.keys_to_store:
            adapter.complete_store(out.keys_to_store, req)
        if finish:
            adapter.on_request_finished(req)
        return list(out.keys_to_store)

    old = [_key(i) for i in range(4)]
    assert offer("a", old) == []  # below the threshold: 4 threshold skips
    assert offer("b", old) == old  # the cache is full now
    with_admission = next(i for i, (_, on) in enumerate(policy.CANDIDATES) if on)
    policy._switch(with_admission)  # type: ignore[attr-defined]
    new = [_key(10), _key(11)]
    assert offer("c", new, finish=False) == []  # threshold: 2 more
    assert offer("d", new) == []  # past the threshold, declined by the policy: 2
    reported = adapter.get_stats()
    assert _counter(reported, "vllm:kv_offload_stores_skipped") == 6
    assert _counter(reported, "vllm:kvtier_stores_skipped") == 8
    stats = adapter.manager.stats()
    assert (stats["stores_skipped"], stats["stores_below_threshold"]) == (8, 6)


# ------------------------------------------------------------ (2) policy switches
def test_policy_switches_before_a_cache_reset_are_not_lost() -> None:
    """The adaptive policy's ``switches`` restarted at 0 when vLLM reset the
    cache, and the stats guessed a restart when the total dropped: the
    switches made between the last report and the reset were never
    reported. The count now survives the reset, and the exported counter is
    exact."""
    from kvtier.vllm.adapter import KVTierOffloadingManager

    adapter = KVTierOffloadingManager(OffloadManager(64, policy="default"))
    policy = adapter.manager.policy
    for _ in range(3):
        policy._switch(1)  # type: ignore[attr-defined]
    assert _counter(adapter.get_stats(), "vllm:kvtier_policy_switches") == 3
    for _ in range(2):  # not reported before the reset
        policy._switch(1)  # type: ignore[attr-defined]
    adapter.reset_cache()
    policy._switch(1)  # type: ignore[attr-defined]
    assert _counter(adapter.get_stats(), "vllm:kvtier_policy_switches") == 3
    assert _counter(adapter.get_stats(), "vllm:kvtier_policy_switches") == 0
    assert policy.switches == 6  # type: ignore[attr-defined]
    assert adapter.manager.stats()["policy_switches"] == 6


def test_the_trace_recorders_counts_are_counters_while_it_records(tmp_path: Path) -> None:
    from kvtier import block_key
    from kvtier.replay.recorder import TraceRecorder
    from kvtier.vllm.adapter import KVTierOffloadingManager

    plain = KVTierOffloadingManager(OffloadManager(64)).get_stats().data["data"]
    assert "vllm:kvtier_trace_recorded" not in plain
    recorder = TraceRecorder(tmp_path / "t.jsonl")
    adapter = KVTierOffloadingManager(OffloadManager(64), recorder=recorder)
    for i in range(3):
        recorder.record(float(i), [(block_key(i), 32)])
    adapter.shutdown()  # closes the recorder: every queued request written
    stats = adapter.get_stats()
    assert _counter(stats, "vllm:kvtier_trace_recorded") == 3
    assert "vllm:kvtier_trace_dropped" in stats.data["data"]
    assert _counter(stats, "vllm:kvtier_trace_dropped") == 0


def test_a_plug_in_policys_counter_that_restarts_is_still_read_as_a_restart() -> None:
    """The restart handling stays for policy counters only (a plug-in policy
    may start its ``switches`` again at ``clear()``); kvtier's own totals
    never drop, and a drop is not reported as an increase."""
    from kvtier.vllm.metrics import fill_stats

    base = {"hits": 0, "misses": 0, "stores": 0, "evictions": 0, "stores_skipped": 0,
            "stores_below_threshold": 0, "allocation_failures": 0, "events_dropped": 0,
            "resident": 0, "pinned": 0, "leased": 0, "write_pending": 0, "unevictable": 0}
    reported: dict[str, int] = {}
    fill_stats({**base, "policy_switches": 5, "stores": 7}, 8, reported)
    again = fill_stats({**base, "policy_switches": 2, "stores": 4}, 8, reported).data["data"]
    assert again["vllm:kvtier_policy_switches"][()] == 2
    assert "vllm:kvtier_stores" not in again


def test_a_drop_in_a_kvtier_total_is_not_reported_again_when_it_rises_back() -> None:
    """A lower total of one of kvtier's own counters is not reported, and the
    last total reported stays the baseline: back at 7 after 7 -> 4, nothing
    new happened (the baseline had dropped to 4, and 3 were reported twice)."""
    from kvtier.vllm.metrics import fill_stats

    base = {"hits": 0, "misses": 0, "stores": 0, "evictions": 0, "stores_skipped": 0,
            "stores_below_threshold": 0, "allocation_failures": 0, "events_dropped": 0,
            "resident": 0, "pinned": 0, "leased": 0, "write_pending": 0, "unevictable": 0}
    reported: dict[str, int] = {}
    seen = [fill_stats({**base, "stores": n}, 8, reported).data["data"]
            for n in (7, 4, 7, 9)]
    assert [d.get("vllm:kvtier_stores", {}).get((), 0) for d in seen] == [7, 0, 0, 2]


# ------------------------------------------------------------ (3) promotions
def test_a_promotion_batch_the_pool_refuses_is_not_counted_as_a_promotion(
        tmp_path: Path, region: SlotRegion) -> None:
    """``promotions`` was counted when a lookup batched a promotion; a batch
    the I/O pool then refused at the step's end counted as a promotion and as
    ``promotions_deferred``. Here one I/O thread is held in a read, the queue
    holds one job, and one step batches two (one per tier order): the second
    is refused."""
    from kvtier import RequestContext
    from kvtier.results import LookupResult
    from kvtier.tiers.cascade import TierCascade
    from kvtier.vllm.adapter import KVTierOffloadingManager

    first, second = _disk(tmp_path / "a"), _disk(tmp_path / "b")
    _put(first, [0, 1])
    _put(second, [2])
    gate = Gate(first)
    cascade = TierCascade(OffloadManager(SLOTS), region, [gate, second],
                          io_threads=1, max_queue=1)
    adapter = KVTierOffloadingManager(cascade.manager, cascade)
    try:
        ctx = RequestContext("r")
        assert cascade.lookup_one(_key(0), ctx) is LookupResult.HIT_PENDING
        cascade.on_schedule_end()
        assert gate.entered.wait(10)  # the only I/O thread is held in that read
        assert cascade.lookup_one(_key(1), ctx) is LookupResult.HIT_PENDING  # tiers a, b
        assert cascade.lookup_one(_key(2), ctx) is LookupResult.HIT_PENDING  # tier b only
        cascade.on_schedule_end()  # queues the first batch; the second is refused
        stats = cascade.stats()
        assert (stats["promotions"], stats["promotions_deferred"]) == (2, 1)
        reported = adapter.get_stats()
        assert _counter(reported, "vllm:kvtier_promotions") == 2
        assert _counter(reported, "vllm:kvtier_promotions_deferred") == 1
    finally:
        gate.opened.set()
        cascade.shutdown()


# ------------------------------------------------------------ (4) load source
def test_a_forgotten_source_on_a_disk_only_setup_is_the_disk(
        tmp_path: Path, region: SlotRegion) -> None:
    """README: ``external_unspecified`` is Redis. A promoted block whose tier
    the cascade no longer remembered (its memory of sources is bounded:
    ``max_failed``, 10,000 by default) was reported so, on a setup with no
    Redis at all. With one lower tier, it is that tier."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvtier.tiers.cascade import TierCascade
    from kvtier.vllm.adapter import KVTierOffloadingManager

    disk = _disk(tmp_path / "disk")
    _put(disk, [0, 1])
    cascade = TierCascade(OffloadManager(SLOTS), region, [disk], max_failed=1)
    adapter = KVTierOffloadingManager(cascade.manager, cascade)
    try:
        req = ReqContext(req_id="r")
        adapter.on_new_request(req)
        _settle(adapter, [_key(0), _key(1)], req)
        assert cascade.source_of(_key(0)) is None  # one source remembered: block 1's
        assert adapter.get_load_source(_key(0), req) is CacheHitSource.DISK
        assert adapter.get_load_source(_key(1), req) is CacheHitSource.DISK
    finally:
        cascade.shutdown()


def test_the_source_seen_at_the_hit_is_kept_for_the_request(
        tmp_path: Path, region: SlotRegion, redis_server: Any) -> None:
    """With disk and Redis, the tier a block came from is noted for the
    request when its lookup turns into a HIT, so later promotions pushing it
    out of the cascade's memory do not turn a disk hit into
    ``external_unspecified``; a source already forgotten then is reported as
    not known (vLLM's ``external_unspecified``), never as a guess."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvtier.tiers.cascade import TierCascade
    from kvtier.tiers.redis_tier import RedisTier
    from kvtier.vllm.adapter import KVTierOffloadingManager

    disk = _disk(tmp_path / "disk")
    _put(disk, [0, 1, 2, 3])
    redis = RedisTier(redis_server.url, NS, socket_timeout_s=2.0, connect_timeout_s=1.0)
    cascade = TierCascade(OffloadManager(SLOTS), region, [disk, redis], max_failed=1)
    adapter = KVTierOffloadingManager(cascade.manager, cascade)
    try:
        req = ReqContext(req_id="r")
        adapter.on_new_request(req)
        _settle(adapter, [_key(0)], req)
        other = ReqContext(req_id="other")
        adapter.on_new_request(other)
        _settle(adapter, [_key(1)], other)  # pushes block 0's source out
        assert cascade.source_of(_key(0)) is None
        assert adapter.get_load_source(_key(0), req) is CacheHitSource.DISK
        late = ReqContext(req_id="late")
        adapter.on_new_request(late)
        _settle(adapter, [_key(2), _key(3)], late)  # both applied in one poll
        assert adapter.get_load_source(_key(3), late) is CacheHitSource.DISK
        assert adapter.get_load_source(_key(2), late) is CacheHitSource.EXTERNAL_UNSPECIFIED
    finally:
        cascade.shutdown()


# ------------------------------------------------------------ (5) exported counters
def test_events_dropped_and_probes_deferred_are_exported(
        tmp_path: Path, region: SlotRegion, redis_server: Any) -> None:
    """``events_dropped`` (the manager's and each tier's) and the cascade's
    ``probes_deferred`` were counted but had no Prometheus metric: KV cache
    events lost to a stalled subscriber, and Redis lookups answered "not
    found" because the read queue was full, did not show."""
    from kvtier import RequestContext
    from kvtier.results import LookupResult
    from kvtier.tiers.cascade import TierCascade
    from kvtier.tiers.redis_tier import RedisTier
    from kvtier.vllm.adapter import KVTierOffloadingManager
    from kvtier.vllm.metrics import metric_definitions

    disk = _disk(tmp_path / "disk", enable_events=True, max_events=1)
    for i in range(3):
        _put(disk, [i])  # three "stored" events, one kept
    gate = Gate(disk)
    redis = RedisTier(redis_server.url, NS, socket_timeout_s=2.0, connect_timeout_s=1.0)
    manager = OffloadManager(SLOTS, enable_events=True, max_events=1)
    cascade = TierCascade(manager, region, [gate, redis], io_threads=1, max_queue=1)
    adapter = KVTierOffloadingManager(manager, cascade)
    try:
        ctx = RequestContext("r")
        assert cascade.lookup_one(_key(0), ctx) is LookupResult.HIT_PENDING
        cascade.on_schedule_end()
        assert gate.entered.wait(10)  # the only I/O thread is held in that read
        assert cascade.lookup_one(_key(1), ctx) is LookupResult.HIT_PENDING
        assert cascade.lookup_one(_key(9), ctx) is LookupResult.RETRY  # asks Redis
        cascade.on_schedule_end()  # the promotion fills the queue: the probe is not sent
        assert cascade.stats()["probes_deferred"] == 1
        gate.opened.set()
        assert cascade.drain(10)  # two promotions: two "stored" CPU events, one kept
        reported = adapter.get_stats()
        defined = metric_definitions({})
        for name in ("vllm:kvtier_events_dropped", "vllm:kvtier_probes_deferred",
                     "vllm:kvtier_tier_events_dropped"):
            assert name in defined, name
        assert _counter(reported, "vllm:kvtier_probes_deferred") == 1
        assert _counter(reported, "vllm:kvtier_events_dropped") == 1
        assert _counter(reported, "vllm:kvtier_tier_events_dropped", ("disk",)) == 2
    finally:
        gate.opened.set()
        cascade.shutdown()


def test_a_ranked_tier_counts_the_events_its_own_log_dropped(tmp_path: Path) -> None:
    """A tensor-parallel engine's tier (``RankedTier``) reported only its
    ranks' dropped events, not those of its own block-event log, the one
    vLLM reads: ``vllm:kvtier_tier_events_dropped`` stayed 0 while block
    events were lost."""
    from kvtier.tiers.ranks import RankedTier, ShardedSlot

    ranks = [_disk(tmp_path / f"rank{r}", enable_events=True) for r in range(2)]
    tier = RankedTier(ranks, enable_events=True, max_events=1)
    half = np.zeros(SIZE // 2, dtype=np.uint8)
    try:
        for i in range(3):  # three blocks stored, one event kept
            assert tier.put([(_key(i), ShardedSlot([half, half]))]) == [True]
        assert tier.stats()["events_dropped"] == 2
    finally:
        tier.close()
