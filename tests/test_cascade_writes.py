"""CascadeWrites: the cascade's write side, on a real SlotRegion and real disk tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import DiskTier, KVLayout
from kvtier.tiers.cascade import TierCascade

NS = KVLayout("test-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 4096
SLOTS = 8


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SlotRegion]:
    with SlotRegion.create("writes-test", SLOTS, SIZE, shm_dir=tmp_path) as r:
        yield r


def disk(path: Path, name: str = "disk") -> DiskTier:
    tier = DiskTier(path, NS, 64 << 20, free_reserve_bytes=0)
    tier.name = name  # two disk tiers, told apart in the promotion's source
    return tier


def store(c: TierCascade, ids: range, req: str) -> None:
    ctx = RequestContext(req)
    out = c.manager.prepare_store([block_key(i) for i in ids], ctx)
    assert out is not None
    c.complete_store(out.keys_to_store, ctx)
    c.manager.on_request_finished(ctx)


def test_write_on_evict_copies_of_one_step_are_bounded_by_the_queue(
    tmp_path: Path, region: SlotRegion
) -> None:
    """Victims beyond ``max_queue`` jobs in one step are dropped and counted."""
    c = TierCascade(OffloadManager(SLOTS), region, [disk(tmp_path / "d")],
                    write_policy="evict", max_queue=2)
    try:
        store(c, range(SLOTS), "fill")
        for i in range(4):  # four evictions in one step: one job each
            store(c, range(100 + i, 101 + i), f"r{i}")
        state = c.debug_state()
        assert state["evicted_jobs"] == 2
        assert c.stats()["dropped_writes"] == 2
        assert c.drain() and c.stats()["cascade_writes"] == 2
        assert c.debug_state()["evicted_jobs"] == 0 and c.manager.stats()["pinned"] == 0
    finally:
        c.shutdown()


def promote(c: TierCascade, key: bytes) -> None:
    ctx = RequestContext("r")
    while c.lookup_one(key, ctx) is not LookupResult.HIT:
        c.on_schedule_end()
    assert c.drain()


def test_a_promoted_block_is_written_to_the_store_tier_that_lacks_it(
    tmp_path: Path, region: SlotRegion
) -> None:
    first, second = disk(tmp_path / "a", "disk-a"), disk(tmp_path / "b", "disk-b")
    key = block_key(7)
    assert first.put([(key, bytes(SIZE))]) == [True]
    c = TierCascade(OffloadManager(SLOTS), region, [first, second])
    try:
        promote(c, key)
        assert c.source_of(key) == "disk-a"
        assert second.contains([key]) == [True]  # written through from the CPU tier
        stats = c.stats()  # the source holds it: skipped, not written again
        assert (stats["cascade_writes"], stats["duplicate_writes_skipped"]) == (1, 1)
    finally:
        c.shutdown()


def test_a_block_promoted_from_the_only_store_tier_is_not_written_back(
    tmp_path: Path, region: SlotRegion
) -> None:
    only = disk(tmp_path / "a", "disk-a")
    key = block_key(7)
    assert only.put([(key, bytes(SIZE))]) == [True]
    c = TierCascade(OffloadManager(SLOTS), region, [only])
    try:
        promote(c, key)
        stats = c.stats()
        assert (stats["cascade_writes"], stats["duplicate_writes_skipped"]) == (0, 0)
    finally:
        c.shutdown()
