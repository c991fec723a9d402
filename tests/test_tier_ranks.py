"""Tensor-parallel engines: a block is one shard per rank (RankRegions,
RankedTier), through the real cascade with real slot regions and disk tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import DiskTier, KVLayout
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.ranks import RankedTier, RankRegions, ShardedSlot

SIZE = 4096
SLOTS = 4
RANKS = 2


def shard(i: int, rank: int) -> np.ndarray:
    return np.random.default_rng([i, rank]).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[RankRegions]:
    made = [SlotRegion.create(f"ranks-test-{r}", SLOTS, SIZE, shm_dir=tmp_path)
            for r in range(RANKS)]
    yield RankRegions(made)
    for region in made:
        region.close()


def disks(tmp_path: Path) -> RankedTier:
    return RankedTier([
        DiskTier(tmp_path / "disk", KVLayout("m", "bfloat16", 16, 2, 2, 64, tp_rank=r,
                                             tp_size=RANKS).namespace(),
                 16 << 20, free_reserve_bytes=0)
        for r in range(RANKS)
    ])


def store(c: TierCascade, regions: RankRegions, ids: list[int], req: str) -> None:
    ctx = RequestContext(req)
    keys = [block_key(i) for i in ids]
    out = c.prepare_store(keys, ctx)
    assert out is not None
    for key, slot in zip(out.keys_to_store, out.block_ids, strict=True):
        for rank, part in enumerate(regions.slot_array(slot).parts):
            part[:] = shard(ids[keys.index(key)], rank)
    c.complete_store(out.keys_to_store, ctx)
    c.on_request_finished(ctx)


def settle(c: TierCascade, key: bytes, ctx: RequestContext) -> LookupResult:
    for _ in range(5000):
        r = c.lookup_one(key, ctx)
        if r not in (LookupResult.HIT_PENDING, LookupResult.RETRY):
            return r
        c.on_schedule_end()
        c.drain(1)
    raise AssertionError("lookup never settled")


def evict(c: TierCascade, regions: RankRegions) -> None:
    assert c.drain()
    store(c, regions, list(range(100, 100 + SLOTS)), "filler")
    assert c.drain()


@pytest.mark.parametrize("policy", ["store", "evict"])
def test_every_rank_gets_its_shard_back(
    tmp_path: Path, regions: RankRegions, policy: str
) -> None:
    tier = disks(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), regions, [tier], write_policy=policy)  # type: ignore[arg-type]
    try:
        store(c, regions, [0, 1], "a")
        evict(c, regions)
        assert not c.manager.contains(block_key(0))
        for rank_tier in tier.ranks:
            assert rank_tier.contains([block_key(0), block_key(1)]) == [True, True]
        ctx = RequestContext("b")
        assert settle(c, block_key(0), ctx) is LookupResult.HIT
        slot = c.manager.prepare_load([block_key(0)], ctx).block_ids[0]
        for rank, part in enumerate(regions.slot_array(slot).parts):
            assert np.array_equal(part, shard(0, rank))  # each rank its own bytes
        c.manager.complete_load([block_key(0)], ctx)
    finally:
        c.shutdown()


def test_a_block_missing_one_shard_is_a_miss(tmp_path: Path, regions: RankRegions) -> None:
    tier = disks(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), regions, [tier])
    try:
        store(c, regions, [0, 1], "a")
        evict(c, regions)
        tier.ranks[1].delete([block_key(0)])
        assert tier.contains([block_key(0), block_key(1)]) == [False, True]
        assert settle(c, block_key(0), RequestContext("b")) is LookupResult.MISS
    finally:
        c.shutdown()


def test_a_corrupt_shard_fails_the_whole_promotion(
    tmp_path: Path, regions: RankRegions
) -> None:
    tier = disks(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), regions, [tier])
    try:
        store(c, regions, [0], "a")
        evict(c, regions)
        rank1 = tier.ranks[1]
        assert isinstance(rank1, DiskTier)
        path = Path(rank1.dir.file(block_key(0)))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF  # rank 1's shard only; rank 0's is intact
        path.write_bytes(bytes(raw))
        assert settle(c, block_key(0), RequestContext("b")) is LookupResult.MISS
        assert c.stats()["promotion_failures"] == 1
        assert c.manager.stats()["write_pending"] == 0 and not c.manager.contains(block_key(0))
    finally:
        c.shutdown()


def test_stats_count_blocks_not_shards(tmp_path: Path) -> None:
    # per-tier metrics (vllm:kvtier_tier_hits...) and the read latency per
    # block divide by them: a block is one hit, one miss or one store
    tier = disks(tmp_path)
    block = ShardedSlot([shard(0, r) for r in range(RANKS)])
    assert tier.put([(block_key(0), block)]) == [True]
    buffers = [ShardedSlot([np.zeros(SIZE, np.uint8) for _ in range(RANKS)]) for _ in range(2)]
    assert tier.get_into([block_key(0), block_key(1)], buffers) == [RANKS * SIZE, None]
    s = tier.stats()
    assert (s["stores"], s["hits"], s["misses"], s["dropped_stores"]) == (1, 1, 1, 0)
    assert s["used_bytes"] == sum(int(t.stats()["used_bytes"]) for t in tier.ranks)


def test_sharded_buffers_are_checked(tmp_path: Path, regions: RankRegions) -> None:
    tier = disks(tmp_path)
    try:
        with pytest.raises(TypeError, match="ShardedSlot"):
            tier.put([(block_key(0), np.zeros(SIZE, np.uint8))])
        with pytest.raises(TypeError, match="ShardedSlot"):
            tier.put([(block_key(0), ShardedSlot([np.zeros(SIZE, np.uint8)]))])
        assert tier.put([(block_key(0), regions.slot_array(0))]) == [True]
        got = tier.get([block_key(0)])[0]
        assert got is not None and len(got) == RANKS * SIZE
    finally:
        tier.close()


def test_rank_regions_must_share_a_geometry(tmp_path: Path) -> None:
    with SlotRegion.create("g1", SLOTS, SIZE, shm_dir=tmp_path) as a, \
            SlotRegion.create("g2", SLOTS + 1, SIZE, shm_dir=tmp_path) as b, \
            pytest.raises(ValueError, match="geometry"):
        RankRegions([a, b])


def test_a_block_one_rank_cannot_store_leaves_no_orphan_shard(
    tmp_path: Path, regions: RankRegions
) -> None:
    layout = [KVLayout("m", "bfloat16", 16, 2, 2, 64, tp_rank=r, tp_size=RANKS).namespace()
              for r in range(RANKS)]
    roomy = DiskTier(tmp_path / "disk", layout[0], 16 << 20, free_reserve_bytes=0,
                     enable_events=True)
    full = DiskTier(tmp_path / "disk", layout[1], 4096, free_reserve_bytes=0,
                    enable_events=True)  # < one block
    tier = RankedTier([roomy, full], enable_events=True)
    try:
        assert tier.put([(block_key(0), regions.slot_array(0))]) == [False]
        assert roomy.contains([block_key(0)]) == [False]  # rank 0's shard removed again
        assert tier.contains([block_key(0)]) == [False]
        assert tier.take_events() == []  # never whole: neither stored nor removed
    finally:
        tier.close()


def test_cpu_thread_binding_splits_this_process_cpus() -> None:
    import os

    from kvtier.demo.engine import cpu_thread_binding

    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_thread_binding(1) == ",".join(map(str, cpus))
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="ranks"):
            cpu_thread_binding(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPUs"):
        cpu_thread_binding(len(cpus) + 1)


# ---------------------------------------------------------------- block events

def evented(tmp_path: Path, blocks: int = 3) -> RankedTier:
    """Ranks of ``blocks`` shards each (room for 3 blocks), events on."""
    from kvtier.tiers.disk_dir import allocated

    tiers = [DiskTier(tmp_path / "disk", KVLayout("m", "bfloat16", 16, 2, 2, 64, tp_rank=r,
                                                   tp_size=RANKS).namespace(),
                      blocks * allocated(SIZE + 256), free_reserve_bytes=0,
                      enable_events=True, rescan_interval_s=None, lookups="inline")
             for r in range(RANKS)]
    return RankedTier(tiers, enable_events=True)


def block(i: int) -> ShardedSlot:
    return ShardedSlot([shard(i, r) for r in range(RANKS)])


def refcounts(tier: RankedTier) -> dict[bytes, int]:
    """What a consumer counting stored / removed announcements believes."""
    refs: dict[bytes, int] = {}
    for event in tier.take_events():
        step = {"stored": 1, "removed": -1, "corrupt": -1}.get(event.kind, 0)
        for key in event.keys:
            refs[key] = refs.get(key, 0) + step
    return refs


def test_a_block_evicted_by_every_rank_is_reported_once(tmp_path: Path) -> None:
    tier = evented(tmp_path)
    for i in range(4):
        assert tier.put([(block_key(i), block(i))]) == [True]
    refs = refcounts(tier)
    assert refs[block_key(0)] == 0 and all(refs[block_key(i)] == 1 for i in (1, 2, 3))
    assert tier.stats()["evictions"] == 1 and tier.stats()["stores"] == 4


def test_a_block_made_whole_again_is_reported_stored(tmp_path: Path) -> None:
    # rank 1's shard goes bad: the block is a miss and gone as a whole; the
    # cascade writes it again, rank 0's old shard being gone with it
    tier = evented(tmp_path)
    assert tier.put([(block_key(0), block(0))]) == [True]
    path = Path(tier.ranks[1].dir.file(block_key(0)))  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    buf = ShardedSlot([np.zeros(SIZE, np.uint8) for _ in range(RANKS)])
    assert tier.get_into([block_key(0)], [buf]) == [None]
    assert [t.stats()["blocks"] for t in tier.ranks] == [0, 0]  # no orphan shard
    assert tier.put([(block_key(0), block(0))]) == [True]
    assert tier.get_into([block_key(0)], [buf]) == [RANKS * SIZE]
    assert refcounts(tier) == {block_key(0): 1}


def test_a_shard_missing_on_a_later_rank_takes_the_earlier_ones(tmp_path: Path) -> None:
    tier = evented(tmp_path)
    assert tier.put([(block_key(0), block(0))]) == [True]
    tier.ranks[1].delete([block_key(0)])  # e.g. kvtier disk verify --repair
    buf = ShardedSlot([np.zeros(SIZE, np.uint8) for _ in range(RANKS)])
    assert tier.get_into([block_key(0)], [buf]) == [None]
    assert [t.stats()["blocks"] for t in tier.ranks] == [0, 0]
    assert refcounts(tier) == {block_key(0): 0}
