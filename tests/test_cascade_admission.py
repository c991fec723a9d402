"""Per-tier admission and write policies of TierCascade, and its tier events
(real SlotRegion, real DiskTier files)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import DiskTier, KVLayout
from kvtier.tiers.cascade import TierCascade

NS = KVLayout("test-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 4096
SLOTS = 4


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SlotRegion]:
    with SlotRegion.create("admission-test", SLOTS, SIZE, shm_dir=tmp_path) as r:
        yield r


def disk(tmp_path: Path, name: str = "disk", events: bool = False) -> DiskTier:
    return DiskTier(tmp_path / name, NS, 64 << 20, free_reserve_bytes=0, enable_events=events)


def offer(c: TierCascade, region: SlotRegion, ids: Sequence[int], req: str) -> None:
    """One request offering ``ids`` through the cascade: store what is granted, finish."""
    ctx = RequestContext(req)
    keys = [block_key(i) for i in ids]
    out = c.prepare_store(keys, ctx)
    if out is not None and out.keys_to_store:
        for key, slot in zip(out.keys_to_store, out.block_ids, strict=True):
            region.slot_array(slot)[:] = payload(ids[keys.index(key)])
        c.complete_store(out.keys_to_store, ctx)
    c.on_request_finished(ctx)


def on_disk(tier: DiskTier, ids: Sequence[int]) -> list[bool]:
    return tier.contains([block_key(i) for i in ids])


def test_threshold_two_writes_a_block_on_its_second_use(
    tmp_path: Path, region: SlotRegion
) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier], store_threshold=2)
    try:
        offer(c, region, [0, 1], "a")
        assert c.drain()
        assert on_disk(tier, [0, 1]) == [False, False]  # one-off so far: no SSD write
        assert c.stats()["writes_not_admitted"] == 2
        offer(c, region, [0], "b")  # resident: the offer is its second use
        assert c.drain()
        assert on_disk(tier, [0, 1]) == [True, False]
        assert np.array_equal(np.asarray(tier.get([block_key(0)])[0]), payload(0))
        offer(c, region, [0], "c")  # third use: no second write
        assert c.drain()
        assert c.stats()["cascade_writes"] == 1 and tier.stats()["stores"] == 1
        assert c.manager.stats()["pinned"] == 0
    finally:
        c.shutdown()


def test_a_hit_counts_as_a_use(tmp_path: Path, region: SlotRegion) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier], store_threshold=2)
    try:
        offer(c, region, [5], "a")
        ctx = RequestContext("b")
        assert c.lookup_one(block_key(5), ctx) is LookupResult.HIT
        assert c.lookup_one(block_key(5), ctx) is LookupResult.HIT  # same request: once
        c.on_schedule_end()  # the due write is submitted at the step's end
        assert c.drain()
        assert on_disk(tier, [5]) == [True]
        assert c.stats()["cascade_writes"] == 1
    finally:
        c.shutdown()


def test_one_request_offering_twice_counts_once(tmp_path: Path, region: SlotRegion) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier], store_threshold=2)
    try:
        ctx = RequestContext("a")
        keys = [block_key(7)]
        out = c.prepare_store(keys, ctx)
        assert out is not None
        region.slot_array(out.block_ids[0])[:] = payload(7)
        c.complete_store(out.keys_to_store, ctx)
        c.prepare_store(keys, ctx)  # a retry of the same request
        c.on_request_finished(ctx)
        assert c.drain()
        assert on_disk(tier, [7]) == [False]
    finally:
        c.shutdown()


def test_evict_policy_with_threshold_keeps_one_off_blocks_off_disk(
    tmp_path: Path, region: SlotRegion
) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier], write_policy="evict",
                    store_threshold=2)
    try:
        offer(c, region, [0, 1], "a")
        offer(c, region, [0], "b")  # block 0 used twice, block 1 once
        assert c.drain() and c.stats()["cascade_writes"] == 0  # nothing evicted yet
        offer(c, region, [100, 101, 102, 103], "filler")  # evicts 0 and 1
        assert c.drain()
        assert not c.manager.contains(block_key(0)) and not c.manager.contains(block_key(1))
        assert on_disk(tier, [0, 1]) == [True, False]
        assert c.stats()["writes_not_admitted"] == 1
    finally:
        c.shutdown()


def test_tiers_have_their_own_thresholds_and_policies(
    tmp_path: Path, region: SlotRegion
) -> None:
    fast, slow = disk(tmp_path, "fast"), disk(tmp_path, "slow")
    c = TierCascade(OffloadManager(SLOTS), region, [fast, slow],
                    write_policy=["store", "evict"], store_threshold=[1, 2])
    try:
        offer(c, region, [0, 1], "a")
        offer(c, region, [1], "b")
        assert c.drain()
        assert on_disk(fast, [0, 1]) == [True, True]  # write-through, every block
        assert on_disk(slow, [0, 1]) == [False, False]  # nothing evicted yet
        offer(c, region, [100, 101, 102, 103], "filler")
        assert c.drain()
        assert on_disk(slow, [0, 1]) == [False, True]  # evicted and used twice
    finally:
        c.shutdown()


def test_use_counts_are_bounded_by_max_tracker_size(
    tmp_path: Path, region: SlotRegion
) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier], store_threshold=2,
                    max_tracker_size=8)
    try:
        for i in range(40):
            offer(c, region, [i], f"r{i}")
        assert c._writes.uses.counting and len(c._writes.uses) <= 8
        offer(c, region, [0], "again")  # forgotten: counts as a first use again
        assert c.drain() and on_disk(tier, [0]) == [False]
    finally:
        c.shutdown()


@pytest.mark.parametrize("kwargs", [
    {"store_threshold": 0}, {"store_threshold": [1, 1]}, {"store_threshold": True},
    {"write_policy": ["store", "store"]}, {"max_tracker_size": 0},
])
def test_bad_cascade_settings_are_refused(
    tmp_path: Path, region: SlotRegion, kwargs: dict
) -> None:
    with pytest.raises(ValueError):
        TierCascade(OffloadManager(SLOTS), region, [disk(tmp_path)], **kwargs)


def test_tier_events_come_out_with_the_tier_as_medium(
    tmp_path: Path, region: SlotRegion
) -> None:
    tier = disk(tmp_path, events=True)
    c = TierCascade(OffloadManager(SLOTS), region, [tier])
    try:
        offer(c, region, [0, 1], "a")
        assert c.drain()
        events = c.take_events()
        stored = [k for e in events if e.kind == "stored" and e.medium == "DISK" for k in e.keys]
        assert sorted(stored) == sorted([block_key(0), block_key(1)])
        tier.delete([block_key(0)])
        removed = [e for e in c.take_events() if e.kind == "removed"]
        assert [e.keys for e in removed] == [(block_key(0),)] and removed[0].medium == "DISK"
        assert c.take_events() == []
    finally:
        c.shutdown()


def test_a_block_promoted_from_one_tier_is_written_to_the_other(
    tmp_path: Path, region: SlotRegion
) -> None:
    upper, lower = disk(tmp_path, "upper"), disk(tmp_path, "lower")
    upper.name = "upper"  # two disk tiers standing in for disk over Redis
    assert lower.put([(block_key(3), payload(3))]) == [True]
    c = TierCascade(OffloadManager(SLOTS), region, [upper, lower], store_threshold=[2, 1])
    try:
        for req in ("a", "b"):  # two requests use it while it is promoted
            ctx = RequestContext(req)
            assert c.lookup_one(block_key(3), ctx) is LookupResult.HIT_PENDING
        c.on_schedule_end()
        assert c.drain()
        assert c.manager.contains(block_key(3))
        assert on_disk(upper, [3]) == [True]  # reached upper's threshold mid-promotion
        assert np.array_equal(np.asarray(upper.get([block_key(3)])[0]), payload(3))
        assert c.stats()["duplicate_writes_skipped"] == 1  # the source tier is not rewritten
    finally:
        c.shutdown()


def test_a_cascade_turns_the_cpu_policys_own_admission_off(
    tmp_path: Path, region: SlotRegion
) -> None:
    """The tiers below are fed from the CPU tier: with admission on, new blocks
    the history never saw would reach no tier at all once the CPU tier is full."""
    from kvtier.policies import AdaptivePolicy

    alone = OffloadManager(SLOTS, policy="adaptive")
    assert isinstance(alone.policy, AdaptivePolicy)
    alone.policy.configure(8, True)
    under = OffloadManager(SLOTS, policy="adaptive")
    assert isinstance(under.policy, AdaptivePolicy)
    under.policy.configure(8, True)
    tier = disk(tmp_path)
    c = TierCascade(under, region, [tier])
    try:
        assert alone.store_gate.policy_admission and not under.store_gate.policy_admission
        for i in range(4):
            ids = list(range(10 * i, 10 * i + SLOTS))
            offer(c, region, ids, f"r{i}")
            assert c.drain()  # written, so the next request may evict them
            ctx = RequestContext(f"alone{i}")
            out = alone.prepare_store([block_key(j) for j in ids], ctx)
            if out is not None and out.keys_to_store:
                alone.complete_store(out.keys_to_store, ctx)
            alone.on_request_finished(ctx)
        assert alone.stats()["stores_skipped"] > 0  # the control: alone, the policy declines
        assert under.stats()["stores_skipped"] == 0
        assert all(all(on_disk(tier, range(10 * i, 10 * i + SLOTS))) for i in range(4))
    finally:
        c.shutdown()
