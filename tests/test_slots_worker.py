"""TransferWorker: engine KV tensors <-> shared-memory slots, byte for byte."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.slots import SlotRegion, TransferResult, TransferWorker
from kvtier.slots.layout import SlotLayout
from kvtier.slots.worker import ROW_COPY_MIN_BYTES, as_block_bytes

# Pages below and above ROW_COPY_MIN_BYTES exercise both copy paths.
PAGES = (512, 3000, ROW_COPY_MIN_BYTES + 4096)
NUM_BLOCKS = 48


def random_tensors(pages: tuple[int, ...], num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-128, 128, (num_blocks, p), dtype=torch.int8, generator=gen) for p in pages
    ]


@pytest.fixture
def region() -> Iterator[SlotRegion]:
    r = SlotRegion.create(f"test-{uuid.uuid4().hex[:12]}", 64, sum(PAGES))
    yield r
    r.close()


def finished(worker: TransferWorker) -> dict[int, TransferResult]:
    return {r.job_id: r for r in worker.get_finished()}


def expected_slot(tensors: list[torch.Tensor], block: int) -> bytes:
    return b"".join(t[block].numpy().tobytes() for t in tensors)


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    ("copy_threads", "asynchronous"), [(1, False), (2, False), (1, True), (3, True)]
)
def test_round_trip_is_byte_identical(
    region: SlotRegion, copy_threads: int, asynchronous: bool
) -> None:
    src = random_tensors(PAGES, NUM_BLOCKS, seed=1)
    dst = [torch.zeros_like(t) for t in src]
    store = TransferWorker(src, region, copy_threads=copy_threads, asynchronous=asynchronous)
    load = TransferWorker(dst, region, copy_threads=copy_threads, asynchronous=asynchronous)
    rng = np.random.default_rng(0)
    # consecutive runs and scattered ids in one batch
    engine_ids = np.concatenate([np.arange(10, 20), rng.permutation(np.arange(20, 48))[:20]])
    slot_ids = np.concatenate([np.arange(30, 40), rng.permutation(30)[:20]])
    store.store(7, engine_ids, slot_ids)
    store.wait({7})
    (result,) = store.get_finished()
    assert result.success and result.job_id == 7
    assert result.num_bytes == len(engine_ids) * sum(PAGES)
    for b, s in zip(engine_ids, slot_ids, strict=True):
        assert region.slot_array(int(s)).tobytes() == expected_slot(src, int(b))

    targets = rng.permutation(NUM_BLOCKS)[: len(slot_ids)]
    load.load(8, slot_ids, targets)
    load.wait([8])
    assert finished(load)[8].success
    for b, t in zip(engine_ids, targets, strict=True):
        for s_t, d_t in zip(src, dst, strict=True):
            assert torch.equal(s_t[int(b)], d_t[int(t)])
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), targets)
    assert all(int(d[untouched].abs().sum()) == 0 for d in dst)
    store.shutdown()
    load.shutdown()


def test_bf16_kv_tensors_are_copied_as_bytes(region: SlotRegion) -> None:
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(8, 2, 4, 32, generator=gen).to(torch.bfloat16)]  # 512 B/block
    dst = [torch.zeros_like(src[0])]
    TransferWorker(src, region).store(1, [5, 6], [0, 1])
    worker = TransferWorker(dst, region)
    worker.load(2, [1, 0], [0, 1])
    assert finished(worker)[2].success
    assert torch.equal(dst[0][0], src[0][6]) and torch.equal(dst[0][1], src[0][5])


def test_kv_groups_use_their_own_tensors(region: SlotRegion) -> None:
    src = random_tensors((1024, 2048, 4096), 16, seed=4)
    dst = [torch.zeros_like(t) for t in src]
    groups = [[0, 1], [2]]
    store = TransferWorker(src, region, groups=groups)
    assert store.layout.offsets == ((0, 1024), (0,))
    store.store(1, [3, 4, 9], [10, 11, 12], group_sizes=[2, 1])
    assert finished(store)[1].num_bytes == 2 * 3072 + 4096
    assert region.slot_array(10)[:3072].tobytes() == expected_slot(src[:2], 3)
    assert region.slot_array(12)[:4096].tobytes() == src[2][9].numpy().tobytes()
    load = TransferWorker(dst, region, groups=groups)
    load.load(2, [10, 11, 12], [0, 1, 2], group_sizes=[2, 1])
    assert finished(load)[2].success
    assert torch.equal(dst[0][0], src[0][3]) and torch.equal(dst[1][1], src[1][4])
    assert torch.equal(dst[2][2], src[2][9])
    assert int(dst[2][0].abs().sum()) == 0  # group 0 blocks never touch tensor 2


@settings(max_examples=25, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 31), st.integers(0, 15)), min_size=1, max_size=16),
)
def test_round_trip_property(pairs: list[tuple[int, int]]) -> None:
    engine_ids = list(dict.fromkeys(b for b, _ in pairs))
    slots = list(dict.fromkeys(s for _, s in pairs))
    n = min(len(engine_ids), len(slots))
    engine_ids, slots = engine_ids[:n], slots[:n]
    src = random_tensors((100, ROW_COPY_MIN_BYTES), 32, seed=n)
    dst = [torch.zeros_like(t) for t in src]
    with SlotRegion.create(f"test-{uuid.uuid4().hex[:12]}", 16, 100 + ROW_COPY_MIN_BYTES) as r:
        TransferWorker(src, r).store(1, engine_ids, slots)
        worker = TransferWorker(dst, r)
        worker.load(2, slots, engine_ids)
        assert finished(worker)[2].success
    for s_t, d_t in zip(src, dst, strict=True):
        assert torch.equal(s_t[engine_ids], d_t[engine_ids])


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize(
    ("engine_ids", "slot_ids", "match"),
    [
        ([1, NUM_BLOCKS], [0, 1], "engine block ids contains 48, outside"),
        ([-1, 2], [0, 1], "engine block ids contains -1, outside"),
        ([1, 2], [0, 64], "slot ids contains 64, outside"),
        ([1, 2, 3], [0, 1], "3 engine block ids but 2 slot ids"),
        ([1, 2], [5, 5], "duplicates"),
        ([[1, 2]], [[0, 1]], "one-dimensional"),
        ([1.5], [0], "must be integers"),
    ],
)
def test_bad_ids_reported_as_failure(
    region: SlotRegion, engine_ids: object, slot_ids: object, match: str
) -> None:
    src = random_tensors(PAGES, NUM_BLOCKS, seed=5)
    worker = TransferWorker(src, region)
    before = region.as_numpy().copy()
    worker.store(1, engine_ids, slot_ids)
    worker.store(2, [3], [3])  # a good job next to the bad one still runs
    results = finished(worker)
    assert set(results) == {1, 2}
    assert not results[1].success and results[1].error is not None
    assert match in results[1].error
    assert results[2].success
    changed = np.flatnonzero((region.as_numpy() != before).any(axis=1))
    assert set(changed.tolist()) <= {3}  # the bad job wrote nothing


def test_bad_load_and_group_sizes_reported(region: SlotRegion) -> None:
    worker = TransferWorker(random_tensors(PAGES, NUM_BLOCKS, seed=6), region)
    worker.load(1, [0, 1], [4, 4])
    worker.load(2, [0, 1], [4, 5], group_sizes=[1, 1])  # only one group exists
    worker.load(3, [0, 1], [4, 5], group_sizes=[3])
    results = finished(worker)
    assert [results[j].success for j in (1, 2, 3)] == [False, False, False]
    assert "load target has duplicates" in str(results[1].error)
    assert "do not fit 1 KV groups" in str(results[2].error)
    assert "sum to 3, not 2" in str(results[3].error)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_copy_error_reported_not_raised(
    region: SlotRegion, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    def broken(self: object) -> None:
        raise RuntimeError("injected copy fault")

    worker = TransferWorker(
        random_tensors(PAGES, NUM_BLOCKS, seed=7), region, asynchronous=asynchronous
    )
    monkeypatch.setattr("kvtier.slots.worker._CopyTask.run", broken)
    worker.store(1, [0, 1], [0, 1])
    worker.wait({1})
    (result,) = worker.get_finished()
    assert not result.success and "injected copy fault" in str(result.error)
    worker.shutdown()


# ---------------------------------------------------------------- construction
def test_slot_too_small_rejected(region: SlotRegion) -> None:
    with pytest.raises(ValueError, match=r"needs 40000 bytes but region .* 23992-byte"):
        TransferWorker(random_tensors((20000, 20000), 4, seed=8), region)


def test_mismatched_or_empty_tensors_rejected(region: SlotRegion) -> None:
    with pytest.raises(ValueError, match="disagree on num_blocks"):
        TransferWorker(
            [torch.zeros(4, 8, dtype=torch.int8), torch.zeros(5, 8, dtype=torch.int8)], region
        )
    with pytest.raises(ValueError, match="at least one KV tensor"):
        TransferWorker([], region)
    with pytest.raises(ValueError, match="cuda_copy must be one of"):
        TransferWorker([torch.zeros(4, 8, dtype=torch.int8)], region, cuda_copy="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="copy_threads"):
        TransferWorker([torch.zeros(4, 8, dtype=torch.int8)], region, copy_threads=0)
    with pytest.raises(ValueError, match="bad tensor indices"):
        TransferWorker([torch.zeros(4, 8, dtype=torch.int8)], region, groups=[[1]])


def test_as_block_bytes_never_copies() -> None:
    t = torch.zeros(6, 4, 32, dtype=torch.float16)
    rows = as_block_bytes(t)
    assert rows.shape == (6, 256) and rows.dtype == torch.uint8
    assert rows.data_ptr() == t.data_ptr()
    with pytest.raises(ValueError, match="without a copy"):
        as_block_bytes(torch.zeros(4, 6, dtype=torch.int16).t())


def test_layout_packs_pages_per_group() -> None:
    layout = SlotLayout.build([10, 20, 30], [[2, 0], [1]])
    assert layout.offsets == ((0, 30), (0,))
    assert layout.group_bytes(0) == 40 and layout.max_slot_bytes == 40
    with pytest.raises(ValueError, match="positive"):
        SlotLayout.build([0])


# ---------------------------------------------------------------- vLLM adapter
def test_vllm_adapter_round_trip(region: SlotRegion) -> None:
    base = pytest.importorskip("vllm.v1.kv_offload.base")
    common = pytest.importorskip("vllm.v1.kv_offload.cpu.common")
    from kvtier.vllm.worker import VllmSlotWorker

    def caches(tensors: list[torch.Tensor]) -> Any:
        return base.CanonicalKVCaches(
            tensors=[base.CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
            group_data_refs=[
                [base.CanonicalKVCacheRef(i, t.shape[1]) for i, t in enumerate(tensors)]
            ],
        )

    src = random_tensors(PAGES, NUM_BLOCKS, seed=10)
    dst = [torch.zeros_like(t) for t in src]
    store, load = VllmSlotWorker(caches(src), region), VllmSlotWorker(caches(dst), region)
    gpu = base.GPULoadStoreSpec([1, 2, 3], group_sizes=[3], block_indices=[0])
    assert store.submit_store(5, gpu, common.CPULoadStoreSpec([9, 10, 11]))
    (res,) = store.get_finished()
    assert (res.job_id, res.success, res.transfer_size) == (5, True, 3 * sum(PAGES))
    gpu_dst = base.GPULoadStoreSpec([7, 8, 9], group_sizes=[3], block_indices=[0])
    assert load.submit_load(6, common.CPULoadStoreSpec([9, 10, 11]), gpu_dst)
    load.wait({6})
    assert [r.success for r in load.get_finished()] == [True]
    for s_t, d_t in zip(src, dst, strict=True):
        assert torch.equal(s_t[1:4], d_t[7:10])
    with pytest.raises(NotImplementedError, match="blocks_per_chunk=2"):
        VllmSlotWorker(caches(src), region, blocks_per_chunk=2)


def test_a_failed_parallel_copy_is_reported_after_every_shard_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the caller frees a failed store's slots at once: a shard still copying
    # then would write into the bytes of the slot's next block. (The failure
    # is injected: a copy cannot be made to fail on demand.)
    import threading

    from kvtier.slots import worker as worker_module

    blocks = 32
    page = 2 * worker_module.PARALLEL_MIN_BYTES // blocks  # copied by both threads
    region = SlotRegion.create(f"test-{uuid.uuid4().hex[:8]}", blocks, page)
    worker = TransferWorker([torch.full((blocks, page), 7, dtype=torch.uint8)], region,
                            copy_threads=2)
    copy = worker_module._CopyTask.run
    released = threading.Event()

    def run(task: Any) -> None:
        if 0 in task.src_ids.tolist():
            raise MemoryError("injected")
        released.wait(0.5)  # still copying when the other shard fails
        copy(task)

    monkeypatch.setattr(worker_module._CopyTask, "run", run)
    try:
        region.as_numpy()[:] = 0
        ids = np.arange(blocks)
        worker.store(1, ids, ids)
        [result] = worker.get_finished()
        assert result.success is False
        region.as_numpy()[blocks - 1][:] = 42  # the slot's next block
        released.set()
        time.sleep(0.1)
        assert int(region.as_numpy()[blocks - 1][0]) == 42
    finally:
        released.set()
        worker.shutdown()
        region.close()
