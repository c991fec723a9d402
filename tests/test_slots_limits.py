"""The slot region and the CPU transfer path: byte paths under bad
input, shutdown, space and memory limits."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier import host_memory
from kvtier.slots import SlotRegion, TransferResult, TransferWorker

PAGES = (512, 3000)
NUM_BLOCKS = 16
REPO = Path(__file__).resolve().parents[1]


def tensors(seed: int, pages: tuple[int, ...] = PAGES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (NUM_BLOCKS, p), dtype=torch.int8, generator=gen)
            for p in pages]


def slot_bytes(src: list[torch.Tensor], block: int) -> bytes:
    return b"".join(t[block].numpy().tobytes() for t in src)


def results(worker: TransferWorker) -> dict[int, TransferResult]:
    return {r.job_id: r for r in worker.get_finished()}


@pytest.fixture
def region() -> Iterator[SlotRegion]:
    r = SlotRegion.create(f"review-{uuid.uuid4().hex[:10]}", 16, sum(PAGES))
    yield r
    r.close()


# ------------------------------------------------------------ region space
SMALL_TMPFS = "size=8m"


def _in_small_tmpfs(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (argv[1] is the directory) in a child with an 8 MiB tmpfs
    of its own, mounted in a private mount namespace (nothing to clean up)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    probe = subprocess.run([unshare, "-rm", "sh", "-c", f"mount -t tmpfs -o {SMALL_TMPFS} "
                            f"tmpfs {mnt}"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode().strip()}")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [unshare, "-rm", "sh", "-c",
         f'mount -t tmpfs -o {SMALL_TMPFS} tmpfs "$1" && exec "$2" "$3" "$1"',
         "sh", str(mnt), sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_region_owns_its_space_so_a_later_one_cannot_take_it(tmp_path: Path) -> None:
    # A sparse region passed the free-space check, the next region took the
    # room, and the first write into the first region was killed by SIGBUS.
    child = _in_small_tmpfs("""
        import sys
        from kvtier.slots import SlotRegion
        a = SlotRegion.create("a", 6, 1 << 20, shm_dir=sys.argv[1], populate=False)
        regions = [a]  # every region stays open
        try:
            regions.append(SlotRegion.create("b", 6, 1 << 20, shm_dir=sys.argv[1]))
        except MemoryError as exc:
            print("refused:", exc)
        a.as_numpy()[:] = 7  # every page of the first region is there
        print("written", int(a.as_numpy().sum()) == 7 * 6 * (1 << 20))
        """, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "refused:" in child.stdout and "cpu_bytes_to_use" in child.stdout
    assert "written True" in child.stdout


def test_regions_created_at_once_fail_cleanly_never_by_sigbus(tmp_path: Path) -> None:
    # The ranks of an engine create their regions at the same time: each
    # passes the free-space check before any of them takes the room. (The
    # check is skipped here to make that interleaving certain.)
    child = _in_small_tmpfs("""
        import os, sys
        from kvtier.slots import region
        region._check_free_space = lambda directory, needed: None
        a = region.SlotRegion.create("a", 6, 1 << 20, shm_dir=sys.argv[1])
        regions = [a]  # every region stays open
        try:
            regions.append(region.SlotRegion.create("b", 6, 1 << 20, shm_dir=sys.argv[1]))
        except MemoryError as exc:
            print("refused:", exc)
        print("left:", sorted(os.listdir(sys.argv[1])))
        """, tmp_path)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "refused:" in child.stdout and "cannot hold them" in child.stdout
    # the refused region left no file (not even its temp file) behind
    assert "left: ['kvtier-a-" in child.stdout and "kvtier-b" not in child.stdout


# ------------------------------------------------------------ worker jobs
def test_an_asynchronous_job_copies_the_ids_it_was_given(region: SlotRegion) -> None:
    # The caller may reuse its id buffers once submit returned; a job queued
    # behind another read them only when it ran and moved other blocks.
    src = tensors(1)
    worker = TransferWorker(src, region, asynchronous=True)
    gate = threading.Event()
    runner = worker._copier._runner  # type: ignore[attr-defined]
    runner.submit(gate.wait, 10)  # the job below stays queued until the gate opens
    engine_ids = np.array([1, 2, 3], dtype=np.int64)
    slot_ids = np.array([4, 5, 6], dtype=np.int64)
    before = region.as_numpy().copy()
    worker.store(1, engine_ids, slot_ids)
    engine_ids[:] = [9, 10, 11]
    slot_ids[:] = [-1, 12, 13]  # -1: numpy would write the last slot
    gate.set()
    worker.wait({1})
    assert results(worker)[1].success
    for block, slot in ((1, 4), (2, 5), (3, 6)):
        assert region.slot_array(slot).tobytes() == slot_bytes(src, block)
    changed = np.flatnonzero((region.as_numpy() != before).any(axis=1))
    assert changed.tolist() == [4, 5, 6]
    worker.shutdown()


@pytest.mark.parametrize(("copy_threads", "asynchronous"), [(1, False), (2, False), (1, True)])
def test_a_job_after_shutdown_fails_and_copies_nothing(
        region: SlotRegion, copy_threads: int, asynchronous: bool) -> None:
    src = tensors(2)
    worker = TransferWorker(src, region, copy_threads=copy_threads, asynchronous=asynchronous)
    worker.store(1, [1], [1])
    worker.shutdown()
    before = region.as_numpy().copy()
    worker.store(2, [2, 3], [2, 3])
    worker.load(3, [1], [5])
    done = results(worker)
    assert done[1].success
    assert not done[2].success and not done[3].success
    assert all(re.search("shut ?down", str(done[j].error)) for j in (2, 3))
    assert np.array_equal(region.as_numpy(), before)
    worker.shutdown()  # twice: nothing to do


def test_one_failing_job_among_many_fails_alone(region: SlotRegion) -> None:
    src = tensors(3)
    worker = TransferWorker(src, region, asynchronous=True)
    worker.store(10, [0, 1], [0, 1])
    worker.store(11, [2, 3], [2, 2])  # duplicate target
    worker.store(12, [4], [region.num_slots])  # out of range
    worker.store(13, [5, 6], [3, 4])
    worker.wait({10, 11, 12, 13})
    done = results(worker)
    assert sorted(done) == [10, 11, 12, 13]
    assert [done[j].success for j in (10, 11, 12, 13)] == [True, False, False, True]
    assert done[13].num_bytes == 2 * sum(PAGES) and done[11].num_bytes == 0
    for block, slot in ((0, 0), (1, 1), (5, 3), (6, 4)):
        assert region.slot_array(slot).tobytes() == slot_bytes(src, block)
    assert worker.get_finished() == []  # each result once
    worker.shutdown()


def test_strided_views_and_mixed_dtypes_round_trip(region: SlotRegion) -> None:
    # KV tensors that are views (a slice of a wider buffer) and of different
    # dtypes per group are copied as their logical bytes.
    gen = torch.Generator().manual_seed(4)
    wide = torch.randint(-128, 128, (NUM_BLOCKS, 1024), dtype=torch.int8, generator=gen)
    half = torch.randn(NUM_BLOCKS, 4, 64, generator=gen).to(torch.float16)  # 512 B/block
    src = [wide[:, 100:612], half]  # 512 B rows at a 1024 B stride
    dst_wide = torch.zeros_like(wide)
    dst = [dst_wide[:, 100:612], torch.zeros_like(half)]
    groups = [[0], [1]]
    store = TransferWorker(src, region, groups=groups)
    store.store(1, [3, 3], [0, 1], group_sizes=[1, 1])
    load = TransferWorker(dst, region, groups=groups)
    load.load(2, [0, 1], [7, 8], group_sizes=[1, 1])
    assert results(store)[1].success and results(load)[2].success
    assert torch.equal(dst[0][7], src[0][3]) and torch.equal(dst[1][8], src[1][3])
    assert int(dst_wide[:, :100].abs().sum()) == 0  # bytes outside the view untouched
    assert int(dst_wide[:, 612:].abs().sum()) == 0
    with pytest.raises(ValueError, match="without a copy"):
        TransferWorker([half.transpose(1, 2)], region)


# ------------------------------------------------------------ memory limits
def _cgroup_tree(tmp_path: Path, proc_cgroup: str, limits: dict[str, str],
                 monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cgroup file system under ``tmp_path`` and this process's
    ``/proc/self/cgroup`` (limits this machine does not have)."""
    root = tmp_path / "cgroup"
    for rel, value in limits.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_cgroup)
    monkeypatch.setattr(host_memory, "PROC_SELF_CGROUP", proc, raising=False)
    return root


def test_a_parent_cgroups_memory_limit_binds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # systemd: a service without a limit in a slice limited to 2 GiB
    root = _cgroup_tree(tmp_path, "0::/infer.slice/vllm.service\n", {
        "infer.slice/memory.max": str(2 << 30),
        "infer.slice/vllm.service/memory.max": "max",
    }, monkeypatch)
    assert host_memory.cgroup_limit_bytes(root) == 2 << 30


def test_a_cgroup_v1_memory_limit_binds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # cgroup v1 with the whole hierarchy mounted: the root has no limit, the
    # process's own memory cgroup has one
    unlimited = "9223372036854771712"
    root = _cgroup_tree(tmp_path, "5:cpu,cpuacct:/\n4:memory:/jobs/job7\n0::/\n", {
        "memory/memory.limit_in_bytes": unlimited,
        "memory/jobs/memory.limit_in_bytes": unlimited,
        "memory/jobs/job7/memory.limit_in_bytes": str(3 << 30),
        "memory/other/memory.limit_in_bytes": str(1 << 20),  # a sibling's: not ours
    }, monkeypatch)
    assert host_memory.cgroup_limit_bytes(root) == 3 << 30


@pytest.mark.parametrize(("copy_threads", "asynchronous"), [(1, False), (2, True)])
def test_a_cpu_store_leaves_no_earlier_blocks_bytes_in_its_slot(
        copy_threads: int, asynchronous: bool) -> None:
    # Fault: a slot is as wide as the largest KV group's block; a CPU store of
    # a smaller group copied its pages and left the rest of the slot as the
    # block it held before (another group's, another request's), and the
    # disk and Redis tiers wrote those bytes with it. The CUDA path zeroes
    # them (tests/test_slots_cuda.py::test_no_stale_gpu_memory_reaches_a_slot).
    src = [torch.full((8, p), fill, dtype=torch.int8)
           for p, fill in ((1024, 1), (2048, 2), (8192, 3))]
    region = SlotRegion.create(f"test-{uuid.uuid4().hex[:12]}", 8, 8192)
    try:
        worker = TransferWorker(src, region, groups=[[0, 1], [2]],
                                copy_threads=copy_threads, asynchronous=asynchronous)
        worker.store(1, [0, 1], [4, 5], group_sizes=[0, 2])  # the large group's blocks
        worker.wait([1])
        assert all(r.success for r in worker.get_finished())
        worker.store(2, [2, 3], [4, 5], group_sizes=[2, 0])  # then the small group's
        worker.wait([2])
        assert all(r.success for r in worker.get_finished())
        rows = region.as_numpy()[[4, 5]]
        assert (rows[:, :1024] == 1).all() and (rows[:, 1024:3072] == 2).all()
        assert not rows[:, 3072:].any(), "a slot kept the bytes of the block before"
        worker.shutdown()
    finally:
        region.close()
