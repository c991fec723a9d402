"""The vLLM plug-in against vLLM 0.32's interface contracts, driven through the
real vLLM types (``ReqContext``, ``OffloadKey``, ``OffloadingConfig``...)
without starting an engine; real slot regions, disk tiers and file systems."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm(-cpu)")

REPO = str(Path(__file__).parent.parent)
SLOT = 4096


def _key(i: int, group: int = 0) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(8, "big"), group)


def _store(adapter: Any, req: Any, keys: list[Any]) -> None:
    out = adapter.prepare_store(keys, req)
    assert out is not None and list(out.keys_to_store) == keys
    adapter.complete_store(keys, req)


# ------------------------------------------------------ has_pending_work
def test_engine_is_kept_stepping_until_the_cascade_io_is_applied(tmp_path: Path) -> None:
    """vLLM keeps stepping an idle engine while ``has_pending_work()`` holds
    (``Scheduler.has_requests``); kvtier's cascade submits write-on-evict copies
    and applies finished writes only in ``on_schedule_end``. Without the hook
    the last step's evicted blocks never reached the disk tier (dropped at
    shutdown) and finished writes kept their slots pinned while idle."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    from kvtier import OffloadManager
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers import DiskTier, KVLayout
    from kvtier.tiers.cascade import TierCascade
    from kvtier.vllm.adapter import KVTierOffloadingManager

    ns = KVLayout("m", "bfloat16", 32, 1, 1, SLOT).namespace()
    disk = DiskTier(tmp_path / "d", ns, 1 << 20, free_reserve_bytes=0, lookups="inline")
    with SlotRegion.create("pending-work", 2, SLOT, shm_dir=tmp_path) as region:
        cascade = TierCascade(OffloadManager(2, policy="lru"), region, [disk],
                              write_policy="evict")
        adapter = KVTierOffloadingManager(cascade.manager, cascade)
        idle = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        try:
            assert not adapter.has_pending_work()
            first, second = [_key(1), _key(2)], [_key(3), _key(4)]
            for name, keys in (("a", first), ("b", second)):  # b evicts a's blocks
                req = ReqContext(req_id=name)
                adapter.on_new_request(req)
                _store(adapter, req, keys)
                adapter.on_request_finished(req)
            # the engine's last busy step is over: it now steps while work is pending
            assert adapter.has_pending_work()
            deadline = time.monotonic() + 10
            while adapter.has_pending_work() and time.monotonic() < deadline:
                adapter.on_schedule_end(idle)
                time.sleep(0.001)
            assert not adapter.has_pending_work()
            assert disk.contains(first) == [True, True]  # written on eviction
            assert cascade.stats()["dropped_writes"] == 0
            assert cascade.manager.stats()["unevictable"] == 0
        finally:
            adapter.shutdown()


# ------------------------------------------------------ slot region room
_TAKE_ROOM_AFTER_CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path
    import kvtier.slots.region as R

    checked = R._check_free_space

    def check_then_lose_the_room(directory, needed):
        checked(directory, needed)  # passes: the room is there now
        # another rank's or engine's region takes it before the pages are touched
        with open(Path(directory) / "other-engine", "wb") as f:
            f.write(b"x" * (600 << 10))

    R._check_free_space = check_then_lose_the_room
    try:
        R.SlotRegion.create("room", 128, 4096, shm_dir=sys.argv[1])
    except MemoryError as exc:
        print("MemoryError:", exc)
        sys.exit(3)
    print("created")
""")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    """A real 1 MiB tmpfs (a full /dev/shm in small), or skip without mount rights."""
    mount = tmp_path / "shm"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_region_whose_room_is_taken_after_the_check_is_refused_not_killed(
        small_tmpfs: Path) -> None:
    """Each rank's worker creates its region after checking the free space;
    when another process takes that room before the pages are touched, the
    worker died of SIGBUS (no message, a half-made region left behind). Now
    the room is claimed when the file is made: MemoryError, nothing left."""
    run = subprocess.run([sys.executable, "-c", _TAKE_ROOM_AFTER_CHECK, str(small_tmpfs)],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 3, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "cannot hold them" in run.stdout
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["other-engine"]


# ------------------------------------------------------ counters
def _counter(stats: Any, name: str) -> float:
    return float(stats.data["data"].get(name, {}).get((), 0))


def test_a_counter_that_restarts_at_a_cache_reset_still_counts() -> None:
    """``vllm:kvtier_policy_switches`` comes from the adaptive policy, whose
    count starts again from 0 when vLLM resets the connector's cache. The
    adapter reported only increases over the pre-reset total, so the switches
    after a reset went unreported until they outnumbered the earlier ones."""
    from kvtier import OffloadManager
    from kvtier.vllm.adapter import KVTierOffloadingManager

    adapter = KVTierOffloadingManager(OffloadManager(64, policy="default"))  # adaptive
    policy = adapter.manager.policy
    for _ in range(3):
        policy._switch(1)  # type: ignore[attr-defined]
    assert _counter(adapter.get_stats(), "vllm:kvtier_policy_switches") == 3
    adapter.reset_cache()
    for _ in range(2):
        policy._switch(1)  # type: ignore[attr-defined]
    assert _counter(adapter.get_stats(), "vllm:kvtier_policy_switches") == 2
    assert _counter(adapter.get_stats(), "vllm:kvtier_policy_switches") == 0  # no change


# ------------------------------------------------------ hybrid KV layouts
def test_policy_admission_keeps_every_kv_group_of_an_admitted_block() -> None:
    """vLLM offers a hybrid model's blocks group by group ([g0c0, g0c1, g1c0,
    g1c1]) and a hit needs every group's block of a chunk. The adaptive
    policy's admission declines a suffix of the offer: it declined all of
    group 1 (also chunk 0, which it knows) and stored group 0's chunk 0 alone,
    a slot no request can ever hit. The suffix is now taken in token order,
    and what is stored keeps the offer's order (vLLM pairs it with the slots)."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier import OffloadManager
    from kvtier.vllm.adapter import KVTierOffloadingManager

    adapter = KVTierOffloadingManager(OffloadManager(4, policy="default"))
    policy = adapter.manager.policy

    def offer(name: str, keys: list[Any], positions: list[int]) -> list[Any]:
        req = ReqContext(req_id=name)
        adapter.on_new_request(req)
        for key, end in zip(keys, positions, strict=True):
            req.set_offload_key_position(key, end)
        out = adapter.prepare_store(keys, req)
        assert out is not None
        if out.keys_to_store:
            adapter.complete_store(out.keys_to_store, req)
        adapter.on_request_finished(req)
        return list(out.keys_to_store)

    chunk0 = [_key(1, 0), _key(1, 1)]
    assert offer("a", chunk0, [32, 32]) == chunk0  # the policy's history knows chunk 0
    others = [_key(10 + i) for i in range(4)]
    assert offer("x", others, [32, 64, 96, 128]) == others  # the tier is full
    with_admission = next(i for i, (_, on) in enumerate(policy.CANDIDATES) if on)
    policy._switch(with_admission)  # type: ignore[attr-defined]
    hybrid = [_key(1, 0), _key(2, 0), _key(1, 1), _key(2, 1)]  # group 0, then group 1
    stored = offer("b", hybrid, [32, 64, 32, 64])
    assert stored == chunk0  # both groups of the known chunk, in the offer's order
    assert adapter.manager.stats()["stores_skipped"] == 2


# ------------------------------------------------------ spec geometry
def _config(extra: dict[str, Any], *, rank: int = 0, world: int = 1,
            blocks_per_chunk: int = 1, engine_id: str = "review", pp: int = 1) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),), worker_kv_bytes_per_block=SLOT,
        enable_kv_cache_events=False, extra_config=extra, engine_id=engine_id,
        model=OffloadingModelConfig("m", "bfloat16"),
        cache=OffloadingCacheConfig(16, blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank, world, world // pp, pp, 1, 1, 0, 1, None, False))


def test_offloaded_blocks_larger_than_an_engine_block_are_refused_by_name() -> None:
    """The block-size limit: one slot holds one engine block, so a 'block_size'
    (or 'blocks_per_chunk') that makes vLLM coalesce blocks stops the engine
    with a message naming both keys, not a transfer failure later."""
    from kvtier.vllm import ConfigError
    from kvtier.vllm.spec import KVTierSpec

    with pytest.raises(ConfigError, match=r"blocks_per_chunk=2.*'block_size'/'blocks_per_chunk'"):
        KVTierSpec(_config({"cpu_bytes_to_use": 64 * SLOT, "block_size": 32},
                           blocks_per_chunk=2))


def test_tensor_parallel_ranks_get_their_own_regions_of_one_geometry() -> None:
    """cpu_bytes_to_use is shared by the ranks: each rank's worker makes its own
    region of cpu_bytes / (slot * ranks) slots, and the scheduler attaches all."""
    import uuid

    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from kvtier.tiers.ranks import RankRegions
    from kvtier.vllm.spec import KVTierSpec

    extra = {"cpu_bytes_to_use": 16 * SLOT}
    engine = f"review-tp-{uuid.uuid4().hex[:8]}"
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros((4, SLOT), dtype=torch.int8),
                                                       SLOT)], [[CanonicalKVCacheRef(0, SLOT)]])
    workers = [KVTierSpec(_config(extra, rank=r, world=2, engine_id=engine)).get_worker(caches)
               for r in range(2)]
    try:
        regions = [w.region for w in workers]  # type: ignore[attr-defined]
        assert [r.num_slots for r in regions] == [8, 8]
        assert regions[0].name != regions[1].name
        scheduler = KVTierSpec(_config(extra, world=2, engine_id=engine))
        assert scheduler.num_slots == 8
        attached = scheduler._region_attacher()()
        assert isinstance(attached, RankRegions)
        attached.close()  # type: ignore[attr-defined]
    finally:
        for w in workers:
            w.shutdown()
    assert not any(Path(r.path).exists() for r in regions)


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_pipeline_parallel_engines_are_refused_at_start(role: str) -> None:
    """Fault: with pipeline parallelism each stage holds other layers, so each
    process's worker_kv_bytes_per_block differs, and each sized its slots from
    its own: on uneven stages (5 layers over 4 stages) a worker's region had
    fewer slots than the scheduler (rank 0's count) handed out, and a store
    past its end failed, which vLLM asserts on. Only disk/Redis tiers refused
    PP; the CPU tier alone started. Now every role refuses it by name."""
    from kvtier.vllm import ConfigError
    from kvtier.vllm.spec import KVTierSpec

    rank = 0 if role == "scheduler" else 2
    with pytest.raises(ConfigError, match=r"not pipeline-parallel ones \(pp_size=4\)"):
        KVTierSpec(_config({"cpu_bytes_to_use": 64 * SLOT}, rank=rank, world=4, pp=4))


def test_canonical_layout_is_said_to_be_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's canonical_layout (topology-free pages) was accepted and silently
    ignored: a user counting on blocks shared across TP sizes got none, with
    no word why. Now a start-up warning says it (the bytes stay per rank, so
    it was never a wrong block)."""
    from kvtier.vllm.spec import KVTierSpec

    with caplog.at_level("WARNING", logger="kvtier.vllm.spec"):
        KVTierSpec(_config({"cpu_bytes_to_use": 64 * SLOT, "canonical_layout": True}))
    assert "canonical_layout is ignored" in caplog.text
