"""TransferWorker on CUDA: byte-identical copies, ordering against the engine's
stream, pinned registration of the region, failures and shutdown.

Every test here but the copy-mode rule's needs a CUDA device and is skipped
without one (CI has none); they are run on a GPU machine when a session is
lent one (docs/costs.md, "Copy bandwidth").
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvtier.slots import SlotRegion, TransferResult, TransferWorker
from kvtier.slots.cuda import MEMCPY_MAX_RUNS, MEMCPY_MIN_RUN_BYTES, clear_cuda_error, pick_copy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# KV tensors of mixed dtypes and page sizes, in two KV groups.
SHAPES = ((torch.bfloat16, (2, 16, 64)), (torch.float16, (3, 16, 32)), (torch.float32, (16, 40)))
GROUPS = [[0, 2], [1]]
NUM_BLOCKS = 96
NUM_SLOTS = 128
# GPU cycles the engine's stream sleeps before writing: long enough (tens of
# milliseconds) that a copy not ordered after the write would surely read
# the old bytes.
ENGINE_BUSY_CYCLES = 200_000_000
# how bytes cross between the staging buffer and the slots (kvtier.slots.cuda)
MODES = ["memcpy", "mapped", "auto"]


def kv_tensors(seed: int, device: str = "cuda") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn((NUM_BLOCKS, *shape), generator=gen).to(dtype).to(device)
        for dtype, shape in SHAPES
    ]


def slot_bytes() -> int:
    per_block = [dtype.itemsize * int(np.prod(shape)) for dtype, shape in SHAPES]
    return max(sum(per_block[i] for i in group) for group in GROUPS)


@pytest.fixture
def region() -> Iterator[SlotRegion]:
    r = SlotRegion.create(f"test-cuda-{uuid.uuid4().hex[:12]}", NUM_SLOTS, slot_bytes())
    yield r
    r.close()


def results(worker: TransferWorker, job_ids: set[int]) -> dict[int, TransferResult]:
    worker.wait(job_ids)
    got = {r.job_id: r for r in worker.get_finished()}
    assert set(got) == job_ids
    return got


def group_bytes(worker: TransferWorker, group: int) -> int:
    return worker.layout.group_bytes(group)


# ---------------------------------------------------------------- bytes
@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_a_cuda_store_writes_the_slots_a_cpu_store_writes(region: SlotRegion, mode: str) -> None:
    # one slot format for both backends: disk and Redis blocks written by a
    # CPU engine are loaded by a GPU engine and the other way round
    src = kv_tensors(seed=1)
    gpu = TransferWorker(src, region, groups=GROUPS, cuda_copy=mode)
    engine = np.array([5, 6, 7, 8, 40, 3, 90, 91])  # runs and scattered ids
    slots = np.array([10, 11, 12, 13, 0, 77, 50, 51])
    gpu.store(2, engine, slots, group_sizes=[5, 3])
    assert results(gpu, {2})[2].success
    on_gpu = region.as_numpy()[slots].copy()
    gpu.shutdown()

    with SlotRegion.create(f"test-cpu-{uuid.uuid4().hex[:12]}", NUM_SLOTS, slot_bytes()) as cpu_r:
        cpu = TransferWorker([t.cpu() for t in src], cpu_r, groups=GROUPS)
        cpu.store(3, engine, slots, group_sizes=[5, 3])
        assert results(cpu, {3})[3].success
        on_cpu = cpu_r.as_numpy()[slots]
        for row, group in enumerate([0] * 5 + [1] * 3):
            width = group_bytes(cpu, group)
            assert on_gpu[row, :width].tobytes() == on_cpu[row, :width].tobytes(), row


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_a_round_trip_through_the_slots_is_byte_identical(region: SlotRegion, mode: str) -> None:
    src, dst = kv_tensors(seed=2), [torch.zeros_like(t) for t in kv_tensors(seed=2)]
    store = TransferWorker(src, region, groups=GROUPS, cuda_copy=mode)
    load = TransferWorker(dst, region, groups=GROUPS, cuda_copy=mode)
    rng = np.random.default_rng(0)
    engine = rng.permutation(NUM_BLOCKS)[:60]
    slots = rng.permutation(NUM_SLOTS)[:60]
    store.store(1, engine, slots, group_sizes=[40, 20])
    result = results(store, {1})[1]
    assert result.success and result.seconds is not None and result.seconds > 0
    targets = rng.permutation(NUM_BLOCKS)[:60]
    load.load(2, slots, targets, group_sizes=[40, 20])
    assert results(load, {2})[2].success
    for i, (b, t) in enumerate(zip(engine, targets, strict=True)):
        for tensor in GROUPS[0] if i < 40 else GROUPS[1]:
            assert torch.equal(src[tensor][int(b)], dst[tensor][int(t)]), (i, tensor)
    untouched = torch.from_numpy(np.setdiff1d(np.arange(NUM_BLOCKS), targets)).cuda()
    assert all(int(d.index_select(0, untouched).abs().sum()) == 0 for d in dst)
    store.shutdown()
    load.shutdown()


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_queued_jobs_run_in_order_like_the_cpu_worker(region: SlotRegion, mode: str) -> None:
    # stores and loads queued without waiting: a load after a store of the
    # same slot must see that store, a store after a load must see the load
    rng = np.random.default_rng(3)
    gpu_kv, cpu_kv = kv_tensors(seed=3), kv_tensors(seed=3, device="cpu")
    gpu = TransferWorker(gpu_kv, region, groups=GROUPS, cuda_copy=mode)
    with SlotRegion.create(f"test-cpu-{uuid.uuid4().hex[:12]}", NUM_SLOTS, slot_bytes()) as cpu_r:
        cpu = TransferWorker(cpu_kv, cpu_r, groups=GROUPS)
        last_group: dict[int, int] = {}  # slot -> KV group of its last store
        submitted: set[int] = set()
        for job in range(200):
            # few slots, so that jobs overlap often; a slot holds blocks of
            # one KV group, as a key names one group
            split, rest = int(rng.integers(0, 8)), int(rng.integers(0, 8))
            n = split + rest
            if n == 0:
                continue
            engine = rng.permutation(NUM_BLOCKS)[:n]
            slots = np.concatenate([rng.permutation(16)[:split], 16 + rng.permutation(16)[:rest]])
            store = bool(rng.random() < 0.5)
            submitted.add(job)
            for w in (gpu, cpu):
                if store:
                    w.store(job, engine, slots, group_sizes=[split, n - split])
                else:
                    w.load(job, slots, engine, group_sizes=[split, n - split])
            if store:
                last_group.update({int(s): int(i >= split) for i, s in enumerate(slots)})
        assert all(r.success for r in results(gpu, submitted).values())
        assert all(r.success for r in results(cpu, submitted).values())
        for g, c in zip(gpu_kv, cpu_kv, strict=True):
            assert torch.equal(g.cpu(), c)
        for s, group in last_group.items():
            width = group_bytes(gpu, group)
            assert region.slot_array(s)[:width].tobytes() == cpu_r.slot_array(s)[:width].tobytes()
    gpu.shutdown()


# ---------------------------------------------------------------- the engine's stream
def _engine_writes_late(tensor: torch.Tensor, block: int, value: float) -> None:
    """Queue, on the engine's (current) stream, a long kernel and then a write
    of ``value`` into ``block``: the write lands tens of milliseconds later."""
    torch.cuda._sleep(ENGINE_BUSY_CYCLES)
    tensor[block].fill_(value)


@pytest.fixture(params=[True, False], ids=["ordered", "control-unordered"])
def ordered(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """True; or False with the copy stream's wait for the engine's stream
    removed: the control, which shows the test sees the difference."""
    if not request.param:
        monkeypatch.setattr(torch.cuda.Stream, "wait_stream", lambda self, other: None)
    return bool(request.param)


def _one_float_tensor() -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS, 4096, dtype=torch.float32, device="cuda")]


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_a_store_copies_what_the_engine_stream_wrote_before_it(ordered: bool, mode: str) -> None:
    # the engine computes a block's KV on its stream and submits its store at
    # once; the copy stream must wait for that work
    kv = _one_float_tensor()
    with SlotRegion.create(f"test-{uuid.uuid4().hex[:12]}", 8, 4 * 4096) as r:
        worker = TransferWorker(kv, r, cuda_copy=mode)
        _engine_writes_late(kv[0], 3, 7.0)
        worker.store(1, [3], [0])
        assert results(worker, {1})[1].success
        stored = np.frombuffer(r.slot_array(0).tobytes(), dtype=np.float32)
        worker.shutdown()
    torch.cuda.synchronize()
    if ordered:
        assert (stored == 7.0).all()
    else:
        assert (stored == 0.0).all()  # the copy overtook the engine's write


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_a_load_lands_after_what_the_engine_stream_queued_before_it(
    ordered: bool, mode: str
) -> None:
    # a block the engine still writes (a freed block's last use) and then gets
    # loaded into must end up holding the loaded bytes
    kv = _one_float_tensor()
    with SlotRegion.create(f"test-{uuid.uuid4().hex[:12]}", 8, 4 * 4096) as r:
        np.frombuffer(r.slot_array(2), dtype=np.float32)[:] = 5.0
        worker = TransferWorker(kv, r, cuda_copy=mode)
        _engine_writes_late(kv[0], 9, 7.0)
        worker.load(1, [2], [9])
        assert results(worker, {1})[1].success
        torch.cuda.synchronize()
        worker.shutdown()
    expected = 5.0 if ordered else 7.0
    assert bool((kv[0][9] == expected).all())


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_a_shutdown_waits_for_copies_in_flight(mode: str) -> None:
    kv = [torch.full((NUM_BLOCKS, 4096), 3.0, dtype=torch.float32, device="cuda")]
    with SlotRegion.create(f"test-{uuid.uuid4().hex[:12]}", 8, 4 * 4096) as r:
        worker = TransferWorker(kv, r, cuda_copy=mode)
        torch.cuda._sleep(ENGINE_BUSY_CYCLES)  # the store waits behind this
        worker.store(1, [0, 1, 2], [0, 1, 2])
        worker.shutdown()
        stored = np.frombuffer(r.as_numpy()[:3].tobytes(), dtype=np.float32)
    assert (stored == 3.0).all()


# ---------------------------------------------------------------- pinning
def _register_result(region: SlotRegion) -> int:
    """cudaHostRegister's answer for the region now (undone when it pinned it)."""
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(region.base_address(), region.slots_nbytes, 1))
    if code == 0:
        cudart.cudaHostUnregister(region.base_address())
    else:
        clear_cuda_error()
    return code


@needs_cuda
def test_the_region_is_pinned_for_the_workers_life(region: SlotRegion) -> None:
    already_registered = 712
    assert _register_result(region) == 0
    worker = TransferWorker(kv_tensors(seed=4), region, groups=GROUPS)
    assert _register_result(region) == already_registered
    worker.shutdown()
    assert _register_result(region) == 0
    torch.zeros(4, device="cuda").sum().item()  # no CUDA error left behind


# ---------------------------------------------------------------- failures
@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_a_bad_job_fails_alone_and_the_next_one_runs(region: SlotRegion, mode: str) -> None:
    src = kv_tensors(seed=5)
    worker = TransferWorker(src, region, groups=GROUPS, cuda_copy=mode)
    before = region.as_numpy().copy()
    worker.store(1, [1, NUM_BLOCKS], [0, 1])
    worker.load(2, [0, 1], [4, 4])
    worker.store(3, [2], [5])
    got = results(worker, {1, 2, 3})
    assert not got[1].success and "outside" in str(got[1].error)
    assert not got[2].success and "duplicates" in str(got[2].error)
    assert got[3].success
    changed = np.flatnonzero((region.as_numpy() != before).any(axis=1))
    assert set(changed.tolist()) == {5}
    worker.shutdown()


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_no_stale_gpu_memory_reaches_a_slot(region: SlotRegion, mode: str) -> None:
    # a slot is as wide as the largest group's block; a smaller group's store
    # must not fill the rest from its staging buffer, whose memory last held
    # other blocks (this store's cached buffer held the group-0 blocks below)
    worker = TransferWorker(kv_tensors(seed=6), region, groups=GROUPS, cuda_copy=mode)
    worker.store(1, [1, 2, 3], [0, 1, 2], group_sizes=[3, 0])
    assert results(worker, {1})[1].success
    worker.store(2, [4, 5, 6], [10, 11, 12], group_sizes=[0, 3])
    assert results(worker, {2})[2].success
    small = group_bytes(worker, 1)
    assert small < region.slot_bytes
    assert not region.as_numpy()[[10, 11, 12], small:].any()
    worker.shutdown()


@needs_cuda
def test_an_unknown_copy_mode_is_refused(region: SlotRegion) -> None:
    with pytest.raises(ValueError, match="cuda_copy must be one of"):
        TransferWorker(kv_tensors(seed=7), region, groups=GROUPS, cuda_copy="fast")  # type: ignore[arg-type]


def test_auto_maps_only_segments_of_many_small_runs() -> None:
    many, small, big = MEMCPY_MAX_RUNS * 32, 64 << 10, 2 << 20
    assert pick_copy("auto", many, many * small, mapped=True) == "mapped"
    assert pick_copy("auto", many, many * big, mapped=True) == "memcpy"  # no SM time taken
    assert pick_copy("auto", MEMCPY_MAX_RUNS, MEMCPY_MAX_RUNS * small, mapped=True) == "memcpy"
    assert pick_copy("auto", 1, 256 * small, mapped=True) == "memcpy"  # one run: one call
    assert pick_copy("auto", many, many * MEMCPY_MIN_RUN_BYTES, mapped=True) == "memcpy"
    assert pick_copy("auto", many, many * small, mapped=False) == "memcpy"
    assert pick_copy("mapped", 1, big, mapped=True) == "mapped"
    assert pick_copy("mapped", 1, big, mapped=False) == "memcpy"
    assert pick_copy("memcpy", many, many * small, mapped=True) == "memcpy"
