"""Claims of docs/DESIGN.md that no other test pinned, and faults where the
code broke one (real SlotRegion, real DiskTier files; a delegating wrapper
only delays or fails calls of the real tier)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import DiskTier, KVLayout
from kvtier.tiers.blockfile import BytesLike
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.delegating import DelegatingTier

NS = KVLayout("design-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 4096
SLOTS = 4
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SlotRegion]:
    with SlotRegion.create("design-test", SLOTS, SIZE, shm_dir=tmp_path) as r:
        yield r


def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "disk", NS, 64 << 20, free_reserve_bytes=0)


def offer(c: TierCascade, region: SlotRegion, ids: Sequence[int], ctx: RequestContext) -> None:
    """``ctx`` offers ``ids`` through the cascade and stores what it is granted."""
    keys = [block_key(i) for i in ids]
    out = c.prepare_store(keys, ctx)
    assert out is not None
    for key, slot in zip(out.keys_to_store, out.block_ids, strict=True):
        region.slot_array(slot)[:] = payload(ids[keys.index(key)])
    c.complete_store(out.keys_to_store, ctx)


def settle(c: TierCascade, key: bytes, ctx: RequestContext) -> LookupResult:
    """Look ``key`` up step after step (as vLLM does) until it is HIT or MISS."""
    deadline = time.monotonic() + 10
    while (r := c.lookup_one(key, ctx)) is PENDING:
        assert time.monotonic() < deadline, "promotion never finished"
        c.on_schedule_end()
        time.sleep(0.002)
    return r


class FailingReads(DelegatingTier):
    """A real disk tier whose reads fail (an I/O error) while ``failing`` is set."""

    def __init__(self, inner: DiskTier) -> None:
        super().__init__(inner)
        self.failing = threading.Event()
        self.reads = 0

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self.reads += 1
        if self.failing.is_set():
            raise OSError("EIO (injected)")
        return self.inner.get_into(keys, buffers)


class Renamed(DelegatingTier):
    """A real tier under another name (two disk tiers in one cascade)."""

    def __init__(self, inner: DiskTier, name: str) -> None:
        super().__init__(inner)
        self.name = name


class HeldReads(DelegatingTier):
    """A real disk tier whose reads wait until ``opened`` is set."""

    def __init__(self, inner: DiskTier) -> None:
        super().__init__(inner)
        self.opened = threading.Event()

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self.opened.wait(10)
        return self.inner.get_into(keys, buffers)


# ------------------------------------------------------------ §4 / §7: counting restarts at reset
def test_reset_restarts_a_running_requests_tier_use_count(
    tmp_path: Path, region: SlotRegion
) -> None:
    """§4 "reset() restarts every request's counting", for the per-tier
    admission of §7: a request running across a reset re-offers its blocks
    (vLLM re-offers them from chunk 0) and that offer is a use. The cascade
    counted it with the context's pre-reset state, so it was lost and a block
    two requests used after the reset never reached a threshold-2 disk tier."""
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS, policy="lru"), region, [tier], store_threshold=2)
    try:
        running = RequestContext("running")
        offer(c, region, [7], running)
        c.reset()
        offer(c, region, [7], running)  # the re-offer after the reset: use 1
        other = RequestContext("other")
        assert c.lookup_one(block_key(7), other) is HIT  # use 2: due for the disk
        c.on_request_finished(other)
        c.on_request_finished(running)
        assert c.drain()
        assert tier.contains([block_key(7)]) == [True]
    finally:
        c.shutdown()


def test_reset_restarts_the_count_of_a_request_waiting_on_a_promotion(
    tmp_path: Path, region: SlotRegion
) -> None:
    """The same through a lookup that finds the block being promoted: that
    path answered before the manager saw the context. The second tier (its
    threshold 2) gets the promoted block once two requests used it."""
    first_tier = HeldReads(disk(tmp_path))
    second = DiskTier(tmp_path / "second", NS, 64 << 20, free_reserve_bytes=0)
    c = TierCascade(OffloadManager(SLOTS, policy="lru"), region,
                    [first_tier, Renamed(second, "second")], store_threshold=[1, 2])
    try:
        first_tier.opened.set()
        waiting = RequestContext("waiting")
        offer(c, region, [3], waiting)  # the first tier gets it; the second counts 1 use
        assert c.drain()
        c.reset()  # the CPU copy and the counts are gone; the request keeps running
        first_tier.opened.clear()
        asker = RequestContext("asker")
        assert c.lookup_one(block_key(3), asker) is PENDING  # use 1 after the reset
        c.on_schedule_end()
        assert c.lookup_one(block_key(3), waiting) is PENDING  # use 2
        first_tier.opened.set()
        assert settle(c, block_key(3), asker) is HIT
        assert c.drain()
        assert second.contains([block_key(3)]) == [True]
        for ctx in (asker, waiting):
            c.on_request_finished(ctx)
    finally:
        c.shutdown()


# ------------------------------------------------------------ §7: internal pins are not accesses
def test_a_lower_tiers_read_of_a_cpu_slot_is_not_a_request_access(
    tmp_path: Path, region: SlotRegion
) -> None:
    """§7: write-through reads CPU slots "under an internal pin, which is not a
    request access": the block written keeps its rank and leaves first."""
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS, policy="lru"), region, [tier])
    try:
        for i in range(SLOTS):  # block 0 is the least recent
            ctx = RequestContext(f"r{i}")
            offer(c, region, [i], ctx)
            c.on_request_finished(ctx)
        assert c.drain()
        c.write_through([block_key(0)])  # pinned and read again (the tier skips it)
        assert c.drain() and c.stats()["duplicate_writes_skipped"] == 1
        ctx = RequestContext("new")
        out = c.prepare_store([block_key(50)], ctx)
        assert out is not None and out.evicted_keys == [block_key(0)]
    finally:
        c.shutdown()


# ------------------------------------------------------------ §7: a failing tier degrades to misses
def test_a_block_whose_read_failed_is_a_miss_without_a_promotion_loop(
    tmp_path: Path, region: SlotRegion
) -> None:
    """§7 "A failing tier degrades to misses": a block the tier lists but
    cannot read (an I/O error, the file kept) is a MISS for ``failure_ttl_s``,
    not a new promotion (a slot reserved, a read) at every lookup."""
    tier = FailingReads(disk(tmp_path))
    c = TierCascade(OffloadManager(SLOTS, policy="lru"), region, [tier], failure_ttl_s=60)
    try:
        ctx = RequestContext("w")
        offer(c, region, [1], ctx)
        c.on_request_finished(ctx)
        assert c.drain()
        c.reset()  # the CPU copy is gone, the disk copy stays
        tier.failing.set()
        reader = RequestContext("r")
        assert settle(c, block_key(1), reader) is MISS
        for _ in range(5):
            c.on_schedule_end()
            assert c.lookup_one(block_key(1), reader) is MISS
        assert c.drain()
        assert c.stats()["promotions"] == 1 and tier.reads == 1
        assert not c.manager.contains(block_key(1))
    finally:
        c.shutdown()


# ------------------------------------------------------------ §6: leases bounded
def test_the_requests_holding_leases_are_bounded() -> None:
    """§6 "Leases are bounded ... so an abandoned request cannot hold the
    cache": past ``max_lease_holders`` requests, the oldest holder's leases
    lapse as if timed out (each holder keeps its context alive)."""
    mgr = OffloadManager(8, policy="lru", max_lease_holders=2)
    ctx = RequestContext("w")
    keys = [block_key(i) for i in range(3)]
    out = mgr.prepare_store(keys, ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    holders = [RequestContext(f"h{i}") for i in range(3)]
    for i, holder in enumerate(holders):
        assert mgr.lookup([keys[i]], holder) == 1
    mgr.lookup([block_key(99)], RequestContext("probe"))  # lapses are applied at a lookup
    assert not holders[0].leased and holders[1].leased and holders[2].leased
    assert mgr.debug_state()["lease_holders"] == 2
