"""kvtier's shutdown with a dead or stopped Redis, parts
dropped without shutdown, regions closed under running copies, repeated
shutdowns. Real parts throughout: a real redis-server (stopped with
SIGSTOP), real files, a real slot region and real threads; a delegating
wrapper only records when the real tier's calls start."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.slots.region import SlotRegion
from kvtier.tiers import DiskTier, KVLayout, Tier
from kvtier.tiers.blockfile import BytesLike
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.delegating import DelegatingTier
from kvtier.tiers.io_pool import IOPool, ProbeJob

NS = KVLayout("lifecycle-model", "bfloat16", 16, 2, 2, 64).namespace()
SIZE = 16 * 1024
SLOTS = 16
HANG_GUARD_S = 30.0
"""Only a guard against a hang: no test here asserts a duration."""


class CallLog(DelegatingTier):
    """A real tier that records when each of its data calls starts."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.starts: list[tuple[str, float]] = []
        self.writing = threading.Event()  # a write job's first call has begun

    def _note(self, name: str) -> None:
        self.starts.append((name, time.monotonic()))

    def contains_waiting(self, keys: Sequence[bytes]) -> list[bool]:
        self._note("contains_waiting")
        self.writing.set()
        return self.inner.contains_waiting(keys)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._note("contains")
        return self.inner.contains(keys)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self._note("get_into")
        return self.inner.get_into(keys, buffers)

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        self._note("put")
        return self.inner.put(items)

    def started_after(self, t: float) -> list[str]:
        return [name for name, start in self.starts if start >= t]


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SlotRegion]:
    with SlotRegion.create("lifecycle", SLOTS, SIZE, shm_dir=tmp_path) as r:
        yield r


def store(c: TierCascade, region: SlotRegion, ids: Sequence[int], req: str) -> list[bytes]:
    """Offer ``ids`` as one request, fill the granted slots, complete (the
    write-through to the tiers is submitted here)."""
    ctx = RequestContext(req)
    out = c.manager.prepare_store([block_key(i) for i in ids], ctx)
    assert out is not None
    for n, slot in enumerate(out.block_ids):
        region.slot_array(slot)[:] = n + 1
    c.complete_store(out.keys_to_store, ctx)
    c.on_request_finished(ctx)
    return list(out.keys_to_store)


def shutdown_guarded(c: TierCascade) -> float:
    """``c.shutdown()`` on a thread (a hang fails the test instead of
    blocking it); the monotonic time it began."""
    began = time.monotonic()
    thread = threading.Thread(target=c.shutdown, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "cascade.shutdown hung"
    return began


# ----------------------------------------------------------- stopped Redis
def test_shutdown_with_stopped_redis_starts_no_tier_call_and_counts_drops(
        redis_server: Any, region: SlotRegion) -> None:
    """A write job is inside a call to a stopped (SIGSTOP) Redis when the
    engine shuts down. The old shutdown let the job go on to its ``put``
    (another socket timeout against a server that answers nothing: ~4 s in
    all) and counted the blocks as write failures; no tier call may start
    once shutdown has begun, and the blocks count as dropped writes."""
    from kvtier.tiers.redis_tier import RedisTier

    tier = CallLog(RedisTier(redis_server.url, NS, socket_timeout_s=2.0))
    c = TierCascade(OffloadManager(SLOTS), region, [tier], io_threads=1)
    try:
        store(c, region, [1], "warm")  # connects while the server answers
        assert c.drain(10)
        assert c.stats()["cascade_writes"] == 1
        tier.writing.clear()
        redis_server.pause()
        keys = store(c, region, range(10, 14), "late")
        assert tier.writing.wait(10)  # the job's existence check hangs in the server
        began = shutdown_guarded(c)
    finally:
        redis_server.resume()
    assert tier.started_after(began) == []
    stats = c.stats()
    assert stats["dropped_writes"] == len(keys)
    assert stats["write_failures"] == 0 and stats["writes_in_flight"] == 0
    assert c.manager.stats()["pinned"] == 0  # the job's internal pins are gone


def test_shutdown_drops_queued_reads_against_a_stopped_redis(
        redis_server: Any, region: SlotRegion) -> None:
    """Probes queued behind a hung call must not each try the stopped server
    after shutdown began (the old pool ran every queued read)."""
    from kvtier.tiers.redis_tier import RedisTier

    tier = CallLog(RedisTier(redis_server.url, NS, socket_timeout_s=2.0,
                             failure_threshold=100))
    c = TierCascade(OffloadManager(SLOTS), region, [tier], io_threads=1)
    try:
        assert tier.contains([block_key(0)]) == [False]  # connected
        redis_server.pause()
        entered = threading.Event()

        class First(ProbeJob):
            def run(self, *args: Any) -> None:
                entered.set()
                super().run(*args)

        assert c._pool.submit(First(tier, [block_key(1)]))
        assert entered.wait(10)
        for i in range(3):
            assert c._pool.submit(ProbeJob(tier, [block_key(2 + i)]))
        began = shutdown_guarded(c)
    finally:
        redis_server.resume()
    assert tier.started_after(began) == []


# ----------------------------------------------------------- dropped, not shut down
def test_cascade_dropped_without_shutdown_ends_its_threads(
        tmp_path: Path, region: SlotRegion) -> None:
    """A cascade (and its disk tier with a lookup thread) garbage collected
    without ``shutdown()``: the old I/O threads held their pool, so they
    waited for jobs for ever, and so did the disk tier's lookup thread."""
    tier = DiskTier(tmp_path / "disk", NS, 64 << 20, free_reserve_bytes=0, lookups="thread")
    c = TierCascade(OffloadManager(SLOTS), region, [tier], io_threads=2)
    store(c, region, [1, 2], "r")
    assert c.drain(10)
    assert tier.contains([block_key(99)]) == [False]  # starts the lookup thread
    threads = list(c._pool._threads)
    lookups = tier._lookups
    assert lookups is not None and lookups._thread is not None
    threads.append(lookups._thread)
    assert all(t.is_alive() for t in threads)
    del c, tier, lookups
    gc.collect()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert [t.name for t in threads if t.is_alive()] == []


def test_disk_tier_dropped_without_close_ends_its_lookup_thread(tmp_path: Path) -> None:
    """The lookup thread kept its last call, which holds the tier: the tier
    was never collected, and the thread waited for ever."""
    tier = DiskTier(tmp_path / "disk", NS, 64 << 20, free_reserve_bytes=0, lookups="thread")
    assert tier.contains([block_key(1)]) == [False]
    lookups = tier._lookups
    assert lookups is not None and lookups._thread is not None
    thread = lookups._thread
    del tier, lookups
    gc.collect()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive()


def test_io_pool_dropped_without_shutdown_ends_its_threads() -> None:
    pool = IOPool(3, max_queue=4)
    threads = list(pool._threads)
    del pool
    gc.collect()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads)


# ----------------------------------------------------------- checks that hold already
def test_region_closed_under_copying_threads_never_faults(tmp_path: Path) -> None:
    """Closing a region while threads copy into and out of its slots: each
    copy holds a view, which keeps the mapping (close unmaps once the last
    view is gone); a thread asking for a slot after the close gets a
    ValueError naming the closed region, never a dead mapping."""
    errors: list[str] = []
    for trial in range(10):
        r = SlotRegion.create("close-race", 8, SIZE, shm_dir=tmp_path, name=f"r{trial}.slots")
        started = threading.Barrier(3)

        def copy(r: SlotRegion = r, started: threading.Barrier = started) -> None:
            src = np.full(SIZE, 7, np.uint8)
            started.wait()
            try:
                for _ in range(2000):
                    for s in range(8):
                        view = r.slot_array(s)
                        view[:] = src
                        assert int(view[-1]) == 7
            except ValueError as exc:
                errors.append(str(exc))

        workers = [threading.Thread(target=copy) for _ in range(2)]
        for w in workers:
            w.start()
        started.wait()
        r.close()
        for w in workers:
            w.join(HANG_GUARD_S)
        assert r.closed and not any(w.is_alive() for w in workers)
    assert errors and all("is closed" in e for e in errors)


def test_shutdown_twice_and_before_any_request(tmp_path: Path, region: SlotRegion) -> None:
    tier = DiskTier(tmp_path / "disk", NS, 64 << 20, free_reserve_bytes=0)
    c = TierCascade(OffloadManager(SLOTS), lambda: None, [tier])  # region never attached
    c.shutdown()
    c.shutdown()
    assert not any(t.is_alive() for t in c._pool._threads)
    c2 = TierCascade(OffloadManager(SLOTS), region, [DiskTier(tmp_path / "d2", NS, 64 << 20,
                                                               free_reserve_bytes=0)])
    store(c2, region, [1], "r")
    c2.shutdown()
    c2.shutdown()
    stats = c2.stats()
    assert stats["cascade_writes"] + stats["dropped_writes"] == 1


def test_shutdown_unmaps_the_region_the_cascade_attached(tmp_path: Path,
                                                          region: SlotRegion) -> None:
    """vLLM's scheduler attaches the workers' region through a callable; the
    old shutdown left that mapping (``cpu_bytes_to_use`` of shared memory,
    which the unlinked file frees only with its last mapping) to a later
    garbage collection of the cascade's reference cycles."""
    attached: list[SlotRegion] = []

    def attach() -> SlotRegion:
        attached.append(SlotRegion.attach(region.path))
        return attached[-1]

    tier = DiskTier(tmp_path / "disk", NS, 64 << 20, free_reserve_bytes=0)
    c = TierCascade(OffloadManager(SLOTS), attach, [tier])
    ctx = RequestContext("r")
    out = c.manager.prepare_store([block_key(1)], ctx)
    assert out is not None
    c.complete_store(out.keys_to_store, ctx)  # attaches, writes through
    assert c.drain(10) and c.stats()["cascade_writes"] == 1
    c.shutdown()
    assert len(attached) == 1 and attached[0].closed
    assert not region.closed  # the creator's own mapping is another object
