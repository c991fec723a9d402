"""TierCascade and the manager's promotion API, on a real SlotRegion, real files
and a real redis-server (no mocks of the tiers; a gate wrapper only delays calls)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvtier import MissingBlocksError, OffloadManager, ProtocolError, RequestContext, block_key
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers import DiskTier, KVLayout, Tier
from kvtier.tiers.blockfile import BytesLike
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.delegating import DelegatingTier
from kvtier.tiers.redis_server import RedisServer, find_server_binary

NS = KVLayout("test-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 16 * 1024
SLOTS = 4
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
RETRY = LookupResult.RETRY


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


class Gate(DelegatingTier):
    """A real tier whose ``put``/``get_into`` wait for ``opened`` first."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.opened = threading.Event()
        self.entered = threading.Event()

    def _wait(self) -> None:
        self.entered.set()
        self.opened.wait(10)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self._wait()
        return self.inner.get_into(keys, buffers)

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        self._wait()
        return self.inner.put(items)


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SlotRegion]:
    with SlotRegion.create("cascade-test", SLOTS, SIZE, shm_dir=tmp_path) as r:
        yield r


def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "disk", NS, 64 << 20, free_reserve_bytes=0)


def store(c: TierCascade, region: SlotRegion, ids: Sequence[int], req: str = "w") -> None:
    """Offer ``ids`` as one request, write their bytes into the granted slots, complete."""
    ctx = RequestContext(req)
    keys = [block_key(i) for i in ids]
    out = c.manager.prepare_store(keys, ctx)
    assert out is not None
    for key, slot in zip(out.keys_to_store, out.block_ids, strict=True):
        region.slot_array(slot)[:] = payload(int.from_bytes(key[:-4], "big"))
    c.complete_store(out.keys_to_store, ctx)
    c.manager.on_request_finished(ctx)


def settle(c: TierCascade, key: bytes, ctx: RequestContext, timeout: float = 10.0) -> LookupResult:
    """Look ``key`` up step after step (as vLLM does) until it is HIT or MISS."""
    deadline = time.monotonic() + timeout
    while (r := c.lookup_one(key, ctx)) in (PENDING, RETRY):
        assert time.monotonic() < deadline, "promotion never finished"
        c.on_schedule_end()
        time.sleep(0.002)
    return r


def evict_all(c: TierCascade, region: SlotRegion) -> None:
    """Push the first blocks out of the CPU tier with 4 other blocks."""
    assert c.drain()
    store(c, region, range(100, 100 + SLOTS), req="filler")
    assert c.drain()


# ---------------------------------------------------------------- manager API
def test_reserve_bypasses_admission_and_completes() -> None:
    mgr = OffloadManager(2, store_threshold=2)
    k = block_key(1)
    slots = mgr.reserve([k])
    assert slots is not None and len(slots) == 1
    ctx = RequestContext("r")
    assert mgr.lookup_one(k, ctx) is PENDING
    assert mgr.stats()["write_pending"] == 1 and mgr.admission_count(k) == 0
    with pytest.raises(ProtocolError):
        mgr.reserve([k])
    mgr.complete_reserve([k], success=True)
    mgr.complete_reserve([k], success=True)  # a second completion is ignored
    assert mgr.lookup_one(k, ctx) is HIT
    k2 = block_key(2)
    assert mgr.reserve([k2]) is not None
    mgr.complete_reserve([k2], success=False)
    assert not mgr.contains(k2) and mgr.stats()["free"] == 1


def test_reserve_evicts_and_fails_without_room() -> None:
    mgr = OffloadManager(1)
    a, b = block_key(1), block_key(2)
    assert mgr.reserve([a]) is not None
    assert mgr.reserve([b]) is None  # a is write-pending: not evictable
    mgr.complete_reserve([a])
    assert mgr.reserve([b]) is not None and not mgr.contains(a)


def test_reserve_ignored_after_reset() -> None:
    mgr = OffloadManager(2)
    k = block_key(1)
    mgr.reserve([k])
    mgr.reset()
    mgr.complete_reserve([k], success=True)
    assert not mgr.contains(k) and mgr.stats()["free"] == 2


def test_eviction_listener_that_raises_loses_no_slot() -> None:
    mgr = OffloadManager(2)
    for i in range(2):
        ctx = RequestContext(f"w{i}")
        out = mgr.prepare_store([block_key(i)], ctx)
        assert out is not None
        mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_request_finished(ctx)

    def fail(keys: list[bytes], slots: list[int]) -> None:
        raise MemoryError("copy of an evicted slot")

    mgr.set_eviction_listener(fail)
    with pytest.raises(MemoryError):
        mgr.prepare_store([block_key(2)], RequestContext("w2"))
    s = mgr.stats()
    assert (s["resident"], s["free"], s["evictions"]) == (1, 1, 1)
    mgr.set_eviction_listener(None)
    assert mgr.prepare_store([block_key(3)], RequestContext("w3")) is not None


def test_internal_pin_blocks_eviction_without_recency() -> None:
    mgr = OffloadManager(2, policy="lru")
    a, b, c = block_key(1), block_key(2), block_key(3)
    for i, k in enumerate((a, b)):
        ctx = RequestContext(f"s{i}")
        out = mgr.prepare_store([k], ctx)
        assert out is not None
        mgr.complete_store([k], ctx)
        mgr.on_request_finished(ctx)
    assert mgr.pin_internal([a, a]) == [mgr._slot[a]] * 2
    with pytest.raises(MissingBlocksError):
        mgr.pin_internal([c])
    ctx = RequestContext("s3")
    out = mgr.prepare_store([c], ctx)
    assert out is not None and out.evicted_keys == [b]  # a is pinned
    mgr.complete_store([c], ctx)
    mgr.on_request_finished(ctx)
    mgr.unpin_internal([a])
    assert mgr.stats()["pinned"] == 1
    mgr.unpin_internal([a, a])  # the extra unpin is ignored
    assert mgr.stats()["pinned"] == 0
    ctx = RequestContext("s4")
    out = mgr.prepare_store([b], ctx)
    # a was least recent before the pins and still is: the pins were no access
    assert out is not None and out.evicted_keys == [a]


# ---------------------------------------------------------------- cascade
def test_promotion_round_trip_from_disk(tmp_path: Path, region: SlotRegion) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier])
    try:
        store(c, region, [0, 1])
        evict_all(c, region)
        assert c.stats()["cascade_writes"] == 2 + SLOTS
        k = block_key(0)
        assert not c.manager.contains(k)
        ctx1, ctx2 = RequestContext("r1"), RequestContext("r2")
        assert c.lookup_one(k, ctx1) is PENDING
        assert c.lookup_one(k, ctx2) is PENDING  # same block: no second promotion
        assert settle(c, k, ctx1) is HIT and settle(c, k, ctx2) is HIT
        s = c.stats()
        assert s["promotions"] == 1 and s["promotion_failures"] == 0
        assert tier.stats()["hits"] == 1
        spec = c.manager.prepare_load([k], ctx1)
        assert np.array_equal(region.slot_array(spec.block_ids[0]), payload(0))
        c.manager.complete_load([k], ctx1)
        assert c.lookup_one(block_key(77), ctx1) is MISS  # in no tier
        # the promoted block is not written back: the disk holds it already
        assert c.stats()["cascade_writes"] == 2 + SLOTS
    finally:
        c.shutdown()
    assert not any(t.is_alive() for t in c._pool._threads)


class Slow(DelegatingTier):
    """A real tier whose reads and writes each take ``delay_s`` longer."""

    def __init__(self, inner: Tier, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        time.sleep(self.delay_s)
        return self.inner.get_into(keys, buffers)

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        time.sleep(self.delay_s)
        return self.inner.put(items)


@pytest.mark.parametrize("delay_s", [0.0, 0.2])
def test_time_spent_in_a_tier_shows_in_its_stats(tmp_path: Path, region: SlotRegion,
                                                 delay_s: float) -> None:
    c = TierCascade(OffloadManager(SLOTS), region, [Slow(disk(tmp_path), delay_s)])
    try:
        store(c, region, [0])
        assert c.drain(10)
        evict_all(c, region)
        k = block_key(0)
        assert settle(c, k, RequestContext("r")) is HIT
        st = c.tier_stats()["disk"]
        slow = int(delay_s * 1000)
        assert isinstance(st["read_ms"], int) and isinstance(st["write_ms"], int)
        assert (st["read_ms"] >= slow) and (st["write_ms"] >= slow)
        if not delay_s:  # a fast tier: far below the slow one's figure
            assert st["read_ms"] < 200 and st["write_ms"] < 200 * (1 + SLOTS)
    finally:
        c.shutdown()


def test_resident_key_refused_for_lease_budget_is_not_promoted(
    tmp_path: Path, region: SlotRegion
) -> None:
    c = TierCascade(OffloadManager(SLOTS, max_leases_per_request=1), region, [disk(tmp_path)])
    try:
        store(c, region, [0, 1])
        assert c.drain()
        ctx = RequestContext("r")
        assert c.lookup_one(block_key(0), ctx) is HIT
        assert c.lookup_one(block_key(1), ctx) is MISS  # out of leases, on disk too
        assert c.stats()["promotions"] == 0
    finally:
        c.shutdown()


def test_corrupt_disk_file_is_a_miss_not_a_hang(tmp_path: Path, region: SlotRegion) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier])
    try:
        store(c, region, [0])
        evict_all(c, region)
        path = Path(tier.dir.file(block_key(0)))
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0x40
        path.write_bytes(raw)
        ctx = RequestContext("r")
        k = block_key(0)
        assert settle(c, k, ctx) is MISS
        assert c.stats()["promotion_failures"] == 1 and tier.stats()["corrupt"] == 1
        assert c.manager.stats()["write_pending"] == 0 and not c.manager.contains(k)
        for _ in range(5):  # remembered: no retry loop
            assert c.lookup_one(k, ctx) is MISS
        assert c.stats()["promotions"] == 1
    finally:
        c.shutdown()


def test_failed_key_is_retried_after_its_ttl(tmp_path: Path, region: SlotRegion) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [Gate(tier)], failure_ttl_s=0.05)
    try:
        c.tiers[0].opened.set()  # type: ignore[attr-defined]
        store(c, region, [0])
        evict_all(c, region)
        k = block_key(0)
        Path(tier.dir.file(k)).write_bytes(b"junk")  # present, unreadable
        ctx = RequestContext("r")
        assert settle(c, k, ctx) is MISS
        time.sleep(0.06)
        assert c.lookup_one(k, ctx) is MISS  # the bad file is gone: not found again
        assert c.stats()["promotions"] == 1
    finally:
        c.shutdown()


def cascade_with_a_hung_read(tmp_path: Path, region: SlotRegion,
                             ids: list[int]) -> tuple[TierCascade, Gate]:
    """A cascade (promotion timeout 50 ms) whose disk tier holds ``ids`` and
    whose reads now hang: the promotion of ``ids[0]`` is running, stuck."""
    gate = Gate(disk(tmp_path))
    gate.opened.set()
    c = TierCascade(OffloadManager(SLOTS), region, [gate], promotion_timeout_s=0.05)
    store(c, region, ids)
    evict_all(c, region)
    gate.opened.clear()
    assert c.lookup_one(block_key(ids[0]), RequestContext("first")) is PENDING
    c.on_schedule_end()  # submits the step's promotions
    assert gate.entered.wait(5)
    return c, gate


def test_promotion_timeout_reports_miss_then_frees_slot(
    tmp_path: Path, region: SlotRegion
) -> None:
    c, gate = cascade_with_a_hung_read(tmp_path, region, [0])
    try:
        k, ctx = block_key(0), RequestContext("r")
        time.sleep(0.06)
        assert c.lookup_one(k, ctx) is MISS  # stuck I/O: a miss now, never a hang
        assert c.lookup_one(k, ctx) is MISS
        assert c.stats()["promotion_timeouts"] == 1  # counted once, when first given up
        assert c.manager.stats()["write_pending"] == 1  # slot kept while the thread writes
        gate.opened.set()
        assert c.drain()
        assert c.manager.stats()["write_pending"] == 0 and c.manager.contains(k)
        s = c.stats()  # it landed late: a timeout, not a failure, and not counted again
        assert (s["promotion_timeouts"], s["promotion_failures"], s["promotions"]) == (1, 0, 1)
    finally:
        gate.opened.set()
        c.shutdown()


def test_writes_that_hang_leave_no_slot_reserved_for_promotions(
    tmp_path: Path, region: SlotRegion
) -> None:
    # a disk whose writes hang holds the I/O thread: a promotion queued
    # behind it gives its slot back after promotion_timeout_s, and no new one
    # reserves a slot while the write hangs (a lost mount would otherwise
    # take every CPU slot, one lookup at a time)
    low = disk(tmp_path)
    low.put([(block_key(i), payload(i)) for i in (10, 11)])
    gate = Gate(low)
    c = TierCascade(OffloadManager(SLOTS), region, [gate], io_threads=1,
                    promotion_timeout_s=0.05)
    try:
        store(c, region, [0])
        c.on_schedule_end()
        assert gate.entered.wait(5)  # block 0's write-through hangs
        ctx = RequestContext("r")
        assert c.lookup_one(block_key(10), ctx) is PENDING
        c.on_schedule_end()  # queued behind the write
        assert c.manager.stats()["write_pending"] == 1
        time.sleep(0.06)
        c.on_schedule_end()
        assert c.manager.stats()["write_pending"] == 0  # never started: slot given back
        assert c.stats()["promotion_timeouts"] == 1
        assert c.lookup_one(block_key(11), ctx) is MISS
        assert c.stats()["promotions_stalled"] == 1 and c.manager.stats()["write_pending"] == 0
        gate.opened.set()  # the disk answers again: promotions from it again
        assert c.drain()
        c.on_schedule_end()
        assert settle(c, block_key(11), ctx) is HIT
    finally:
        gate.opened.set()
        c.shutdown()


def test_no_promotion_is_sent_while_every_io_thread_hangs(
    tmp_path: Path, region: SlotRegion
) -> None:
    # the only I/O thread hangs in one tier's write: a healthy tier's
    # promotion could not start in time either
    hung = Gate(disk(tmp_path))
    healthy = DiskTier(tmp_path / "healthy", NS, 64 << 20, free_reserve_bytes=0)
    healthy.put([(block_key(20), payload(20))])
    c = TierCascade(OffloadManager(SLOTS), region, [hung, healthy], io_threads=1,
                    promotion_timeout_s=0.05)
    try:
        store(c, region, [0])
        c.on_schedule_end()
        assert hung.entered.wait(5)
        time.sleep(0.06)
        c.on_schedule_end()  # finds the write overdue
        assert c.lookup_one(block_key(20), RequestContext("r")) is MISS
        assert c.manager.stats()["write_pending"] == 0
        hung.opened.set()
        assert c.drain()
        c.on_schedule_end()
        assert settle(c, block_key(20), RequestContext("r2")) is HIT
    finally:
        hung.opened.set()
        c.shutdown()


def test_the_stalled_tier_is_the_one_a_read_hangs_in(tmp_path: Path, region: SlotRegion) -> None:
    # A promotion tries the disk tiers in order; the first has a stale entry for
    # block 0 (its file is gone), so the read falls through to the second, which hangs.
    first = DiskTier(tmp_path / "a", NS, 64 << 20, free_reserve_bytes=0)
    second = Gate(DiskTier(tmp_path / "b", NS, 64 << 20, free_reserve_bytes=0))
    second.opened.set()
    c = TierCascade(OffloadManager(SLOTS), region, [first, second], promotion_timeout_s=0.05)
    try:
        store(c, region, [0, 50])
        evict_all(c, region)
        second.inner.put([(block_key(1), payload(1))])  # block 1: on the second tier only
        os.unlink(first.dir.file(block_key(0)))
        second.opened.clear()
        ctx = RequestContext("r")
        assert c.lookup_one(block_key(0), ctx) is PENDING
        c.on_schedule_end()
        assert second.entered.wait(5)
        time.sleep(0.06)
        c.on_schedule_end()
        assert c.lookup_one(block_key(50), ctx) is PENDING  # the first tier still serves
        assert c.lookup_one(block_key(1), ctx) is MISS  # the hung one gets nothing new
        assert c.stats()["promotions_stalled"] == 1
    finally:
        second.opened.set()
        c.shutdown()


def fill_free_slots(c: TierCascade, region: SlotRegion, first: int) -> dict[int, int]:
    """Store new blocks one at a time while a slot is free; their slot -> id."""
    placed: dict[int, int] = {}
    for i in range(first, first + SLOTS):
        ctx = RequestContext(f"f{i}")
        out = c.manager.prepare_store([block_key(i)], ctx)
        if out is None or not out.block_ids:
            break
        region.slot_array(out.block_ids[0])[:] = payload(i)
        c.complete_store(out.keys_to_store, ctx)
        c.manager.on_request_finished(ctx)
        placed[out.block_ids[0]] = i
    return placed


def test_reset_holds_back_the_slot_a_late_promotion_writes(
    tmp_path: Path, region: SlotRegion
) -> None:
    # a promotion still reading when the reset stops waiting must not land in
    # a slot the manager gave to another block since (wrong KV as a HIT)
    gate = Gate(disk(tmp_path))
    gate.opened.set()
    c = TierCascade(OffloadManager(SLOTS), region, [gate])
    try:
        store(c, region, [0])
        evict_all(c, region)
        gate.opened.clear()
        assert c.lookup_one(block_key(0), RequestContext("r")) is PENDING
        c.on_schedule_end()
        assert gate.entered.wait(5)
        c.reset(timeout_s=0.05)
        assert c.manager.debug_state()["held_back"] == 1
        placed = fill_free_slots(c, region, 200)
        assert len(placed) == SLOTS - 1
        gate.opened.set()
        assert c.drain()
        assert c.manager.debug_state()["held_back"] == 0 and c.manager.stats()["free"] == 1
        assert not c.manager.contains(block_key(0))  # the abandoned result is dropped
        for slot, i in placed.items():
            assert np.array_equal(region.slot_array(slot), payload(i)), f"slot {slot}"
    finally:
        gate.opened.set()
        c.shutdown()


def test_reset_holds_back_the_slot_a_late_write_reads(tmp_path: Path, region: SlotRegion) -> None:
    # a write-through still running when the reset stops waiting must copy
    # the bytes of its own block, not those of the next block in its slot
    low = disk(tmp_path)
    gate = Gate(low)
    c = TierCascade(OffloadManager(SLOTS), region, [gate])
    try:
        store(c, region, [0])  # its write waits at the gate
        assert gate.entered.wait(5)
        c.reset(timeout_s=0.05)
        placed = fill_free_slots(c, region, 200)
        assert len(placed) == SLOTS - 1
        gate.opened.set()
        assert c.drain()
        assert c.manager.debug_state()["held_back"] == 0
        got = low.get([block_key(0)])[0]
        assert got is not None and np.array_equal(np.frombuffer(got, np.uint8), payload(0))
    finally:
        gate.opened.set()
        c.shutdown()


def test_a_slot_two_late_writes_read_is_held_back_until_both_end(
    tmp_path: Path, region: SlotRegion
) -> None:
    # two write jobs copy one block (tier b takes it at its first use, tier a
    # at its second); a reset stops waiting for both: the first to end must
    # not free the slot the second still copies from
    low_a, low_b = DiskTier(tmp_path / "a", NS, 64 << 20, free_reserve_bytes=0), disk(tmp_path)
    gate_a, gate_b = Gate(low_a), Gate(low_b)
    c = TierCascade(OffloadManager(SLOTS), region, [gate_a, gate_b], store_threshold=[2, 1])
    try:
        first = RequestContext("first")
        out = c.prepare_store([block_key(0)], first)
        assert out is not None
        region.slot_array(out.block_ids[0])[:] = payload(0)
        c.complete_store(out.keys_to_store, first)  # job 1: tier b
        c.on_request_finished(first)
        assert gate_b.entered.wait(5)
        again = c.prepare_store([block_key(0)], RequestContext("again"))
        assert again is not None and again.keys_to_store == []
        c.on_schedule_end()  # job 2: tier a, from the same slot
        assert gate_a.entered.wait(5)
        c.reset(timeout_s=0.05)
        c.reset(timeout_s=0.05)  # a job abandoned twice still ends once
        gate_b.opened.set()
        deadline = time.monotonic() + 5
        while c.stats()["cascade_writes"] < 1:  # job 1 ended and was applied
            assert time.monotonic() < deadline, "job 1 never ended"
            c.on_schedule_end()
            time.sleep(0.005)
        placed = fill_free_slots(c, region, 200)
        assert len(placed) == SLOTS - 1  # not the slot job 2 still reads
        gate_a.opened.set()
        assert c.drain()
        assert c.manager.debug_state()["held_back"] == 0 and c.manager.stats()["free"] == 1
        got = low_a.get([block_key(0)])[0]
        assert got is not None and np.array_equal(np.frombuffer(got, np.uint8), payload(0))
    finally:
        gate_a.opened.set()
        gate_b.opened.set()
        c.shutdown()


def test_write_through_skips_blocks_the_tier_holds(tmp_path: Path, region: SlotRegion) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier])
    try:
        store(c, region, [0, 1])
        assert c.drain()
        c.reset()  # the CPU tier forgets; the disk keeps them
        store(c, region, [0, 1, 2])
        assert c.drain()
        s = c.stats()
        assert s["cascade_writes"] == 3 and s["duplicate_writes_skipped"] == 2
        assert tier.stats()["stores"] == 3
        assert c.manager.stats()["pinned"] == 0
    finally:
        c.shutdown()


def test_full_write_queue_drops_stores(tmp_path: Path, region: SlotRegion) -> None:
    gate = Gate(disk(tmp_path))
    c = TierCascade(OffloadManager(SLOTS), region, [gate], io_threads=1, max_queue=1)
    try:
        store(c, region, [0])  # taken by the only thread, which waits at the gate
        assert gate.entered.wait(5)
        store(c, region, [1])  # queued
        store(c, region, [2, 3])  # queue full: dropped, not pinned
        s = c.stats()
        assert s["dropped_writes"] == 2 and s["queued_writes"] == 1
        assert c.manager.stats()["pinned"] == 2
        gate.opened.set()
        assert c.drain()
        assert c.stats()["cascade_writes"] == 2 and c.manager.stats()["pinned"] == 0
        assert gate.inner.contains([block_key(i) for i in range(4)]) == [True, True, False, False]
    finally:
        gate.opened.set()
        c.shutdown()


def test_lazy_region_drops_writes_until_available(tmp_path: Path, region: SlotRegion) -> None:
    available: list[SlotRegion] = []

    def source() -> SlotRegion | None:
        return available[0] if available else None

    c = TierCascade(OffloadManager(SLOTS), source, [disk(tmp_path)])
    try:
        store(c, region, [0])
        assert c.stats()["dropped_writes"] == 1
        available.append(region)
        store(c, region, [1])
        assert c.drain() and c.stats()["cascade_writes"] == 1
    finally:
        c.shutdown()


def test_evict_policy_writes_blocks_as_the_cpu_tier_evicts_them(
    tmp_path: Path, region: SlotRegion
) -> None:
    tier = disk(tmp_path)
    c = TierCascade(OffloadManager(SLOTS), region, [tier], write_policy="evict")
    try:
        store(c, region, [0, 1])
        assert c.drain() and c.stats()["cascade_writes"] == 0  # nothing evicted yet
        store(c, region, [100, 101, 102, 103])  # evicts 0 and 1, copied before reuse
        assert c.drain() and c.stats()["cascade_writes"] == 2
        assert c.manager.stats()["pinned"] == 0
        ctx = RequestContext("r")
        k = block_key(0)
        assert settle(c, k, ctx) is HIT  # promoted back, evicting a filler (written now)
        spec = c.manager.prepare_load([k], ctx)
        assert np.array_equal(region.slot_array(spec.block_ids[0]), payload(0))
        c.manager.complete_load([k], ctx)
        assert c.drain() and c.stats()["cascade_writes"] == 3
        gone = [i for i in range(100, 104) if not c.manager.contains(block_key(i))]
        assert len(gone) == 1 and tier.contains([block_key(gone[0])]) == [True]
        assert np.array_equal(np.asarray(tier.get([block_key(gone[0])])[0]), payload(gone[0]))
    finally:
        c.shutdown()


def test_per_tier_write_policy_is_checked(tmp_path: Path, region: SlotRegion) -> None:
    with pytest.raises(ValueError, match="write_policy"):
        TierCascade(OffloadManager(SLOTS), region, [disk(tmp_path)], write_policy="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="write_policy"):
        TierCascade(OffloadManager(SLOTS), region, [disk(tmp_path)],
                    write_policy=["store", "evict"])


# ---------------------------------------------------------------- redis
@pytest.fixture
def server() -> Iterator[RedisServer]:
    if find_server_binary() is None:
        pytest.skip("no redis-server binary")
    srv = RedisServer().start()
    yield srv
    srv.close()


def test_redis_round_trip_then_down(
    tmp_path: Path, region: SlotRegion, server: RedisServer
) -> None:
    pytest.importorskip("redis")
    from kvtier.tiers.redis_tier import RedisTier

    tier = RedisTier(server.url, NS, socket_timeout_s=0.3, connect_timeout_s=0.3,
                     failure_threshold=1, reset_timeout_s=30.0)
    c = TierCascade(OffloadManager(SLOTS), region, [tier])
    try:
        store(c, region, [0, 1, 2])
        evict_all(c, region)
        ctx = RequestContext("r")
        assert settle(c, block_key(0), ctx) is HIT
        spec = c.manager.prepare_load([block_key(0)], ctx)
        assert np.array_equal(region.slot_array(spec.block_ids[0]), payload(0))
        c.manager.complete_load([block_key(0)], ctx)
        server.stop(kill=True)
        started = time.monotonic()
        assert settle(c, block_key(1), ctx) is MISS
        assert settle(c, block_key(2), ctx) is MISS
        store(c, region, [50, 51])  # the engine keeps storing into the CPU tier
        assert c.drain(5)
        assert time.monotonic() - started < 5
        assert c.manager.contains(block_key(50)) and c.manager.stats()["pinned"] == 0
    finally:
        c.shutdown()



def test_a_tier_with_an_overdue_read_gets_no_new_promotions(
    tmp_path: Path, region: SlotRegion
) -> None:
    c, gate = cascade_with_a_hung_read(tmp_path, region, [0, 1])
    try:
        ctx = RequestContext("r")
        time.sleep(0.06)
        c.on_schedule_end()  # the step that finds the read overdue
        # block 1 is on the same tier: a miss now, and no second slot held for it
        assert c.lookup_one(block_key(1), ctx) is MISS
        assert c.manager.stats()["write_pending"] == 1
        assert c.stats()["promotions_stalled"] == 1
        assert c.debug_state()["running_promotions"] == 1
        gate.opened.set()  # the tier comes back: promotions from it again
        assert c.drain()
        c.on_schedule_end()
        assert settle(c, block_key(1), ctx) is HIT
        assert c.debug_state()["running_promotions"] == 0
    finally:
        gate.opened.set()
        c.shutdown()


class Unwell(DelegatingTier):
    """A real tier that went away and whose stats() raises."""

    @property
    def available(self) -> bool:
        return False

    def stats(self) -> dict[str, int | float | str]:
        raise OSError("stats: Input/output error")


def test_a_tier_whose_stats_fail_still_reports_its_availability(
        tmp_path: Path, region: SlotRegion) -> None:
    # Fault: a tier whose stats() raised was left out of tier_stats(), so the
    # vllm:kvtier_tier_available gauge kept its last value (1) while the tier
    # was down.
    c = TierCascade(OffloadManager(SLOTS), region, [Unwell(disk(tmp_path))])
    try:
        assert c.tier_stats()["disk"] == {"available": False}
    finally:
        c.shutdown()
