"""SlotRegion: real POSIX shared memory, shared across spawned processes."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

from kvtier.slots.region import (
    RegionHeader,
    SlotRegion,
    cleanup_stale_regions,
    default_shm_dir,
    region_creator,
    region_name,
)

SPAWN = mp.get_context("spawn")

@pytest.fixture
def engine_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"

@pytest.fixture
def region(engine_id: str) -> Iterator[SlotRegion]:
    r = SlotRegion.create(engine_id, num_slots=8, slot_bytes=5000)
    yield r
    r.close()

# ---------------------------------------------------------------- child procs
def _child_read_write(name: str, read_slot: int, write_slot: int, q: mp.Queue) -> None:
    r = SlotRegion.attach(name)
    try:
        q.put((r.num_slots, r.slot_bytes, bytes(r.slot_array(read_slot)[:16])))
        r.slot_array(write_slot)[:] = 0xAB
    finally:
        r.close()

def _child_create_and_die(engine_id: str, q: mp.Queue) -> None:
    r = SlotRegion.create(engine_id, num_slots=2, slot_bytes=4096)
    q.put(str(r.path))
    q.close()
    q.join_thread()
    os._exit(0)  # no close(), no finalizers: like a crashed engine

def _child_create_with_reaper_and_get_killed(engine_id: str, q: mp.Queue) -> None:
    r = SlotRegion.create(engine_id, num_slots=2, slot_bytes=4096, reaper=True)
    q.put(str(r.path))
    q.close()
    q.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)  # what vLLM does to its workers at shutdown

def _child_create_with_reaper_and_wait(name: str, q: mp.Queue) -> None:
    r = SlotRegion.create("test-reaper", num_slots=2, slot_bytes=4096, name=name, reaper=True)
    assert r._reaper is not None
    q.put((str(r.path), r._reaper.pid))
    time.sleep(120)  # killed by the test

def _run(target: Callable[..., None], *args: object, exitcode: int = 0) -> object:
    q: mp.Queue = SPAWN.Queue()
    proc = SPAWN.Process(target=target, args=(*args, q))
    proc.start()
    out = q.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == exitcode
    return out

# ---------------------------------------------------------------- create/attach
def test_create_maps_shared_memory_file(region: SlotRegion, engine_id: str) -> None:
    assert region.path.parent == default_shm_dir()
    assert region.name == region_name(engine_id) == f"kvtier-{engine_id}-{os.getpid()}.slots"
    assert region.path.exists()
    assert (region.num_slots, region.slot_bytes, region.slot_stride) == (8, 5000, 8192)
    assert region.as_numpy().shape == (8, 5000)
    assert region.as_numpy(padded=True).shape == (8, 8192)
    assert region.base_address() % 4096 == 0
    header = RegionHeader.read(region.path)
    assert header.creator_pid == os.getpid()
    assert header.engine_id == engine_id

def test_attach_from_spawned_process_sees_and_writes_bytes(region: SlotRegion) -> None:
    region.slot_array(3)[:16] = np.arange(16, dtype=np.uint8)
    num_slots, slot_bytes, seen = cast(
        tuple[int, int, bytes], _run(_child_read_write, region.name, 3, 5)
    )
    assert (num_slots, slot_bytes) == (8, 5000)
    assert seen == bytes(range(16))
    assert (region.slot_array(5) == 0xAB).all()
    assert (region.slot_array(4) == 0).all()
    assert region.path.exists()  # an attacher's close() never unlinks

def test_views_share_memory_without_copies(region: SlotRegion) -> None:
    arr = region.as_numpy()
    t8 = region.as_torch()
    ti8 = region.as_torch(torch.int8)
    assert t8.dtype == torch.uint8 and ti8.dtype == torch.int8
    assert t8.data_ptr() == ti8.data_ptr() == arr.ctypes.data
    t8[2, 7] = 200
    assert arr[2, 7] == 200 and ti8[2, 7].item() == 200 - 256
    region.slot_array(6)[-1] = 9
    assert t8[6, -1].item() == 9
    with pytest.raises(ValueError, match="uint8 or int8"):
        region.as_torch(torch.float32)

def test_attach_checks_geometry_and_kind(region: SlotRegion, tmp_path: Path) -> None:
    attached = SlotRegion.attach(region.path, num_slots=8, slot_bytes=5000)
    attached.close()
    with pytest.raises(ValueError, match="expected num_slots=9"):
        SlotRegion.attach(region.name, num_slots=9)
    with pytest.raises(FileNotFoundError, match="no slot region"):
        SlotRegion.attach(f"kvtier-missing-{uuid.uuid4().hex}.slots")
    junk = tmp_path / "junk.slots"
    junk.write_bytes(b"x" * 8192)
    with pytest.raises(ValueError, match="not a kvtier slot region"):
        SlotRegion.attach(junk)

def test_create_twice_fails_and_the_creator_is_known(engine_id: str) -> None:
    name = f"kvtier-{engine_id}-rank0.slots"
    first = SlotRegion.create(engine_id, 4, 100, name=name)
    try:
        with pytest.raises(FileExistsError, match="already exists"):
            SlotRegion.create(engine_id, 4, 100, name=name)
        assert region_creator(name) == (os.getpid(), first.header.creator_start_ticks)
    finally:
        first.close()
    assert not (default_shm_dir() / name).exists()
    assert region_creator(name) is None


# ---------------------------------------------------------------- cleanup
def test_close_unlinks_and_is_idempotent(engine_id: str) -> None:
    r = SlotRegion.create(engine_id, 2, 64)
    path = r.path
    view = r.as_numpy()
    view[1, 3] = 5
    r.close()
    r.close()
    assert r.closed and not path.exists()
    assert view[1, 3] == 5  # a live view keeps the mapping valid
    with pytest.raises(ValueError, match="closed"):
        r.as_numpy()

def test_context_manager_unlinks(engine_id: str) -> None:
    with SlotRegion.create(engine_id, 2, 64) as r:
        path = r.path
        assert path.exists()
    assert not path.exists()

def test_stale_region_of_dead_creator_is_removed(engine_id: str) -> None:
    stale_path = Path(str(_run(_child_create_and_die, engine_id)))
    assert stale_path.exists()
    live = SlotRegion.create(f"{engine_id}-new", 2, 64)  # creation cleans up
    try:
        assert not stale_path.exists()
        assert live.path.exists()
        assert cleanup_stale_regions() == []  # our own live region stays
        assert live.path.exists()
    finally:
        live.close()

def test_reaper_removes_the_region_of_a_killed_creator(engine_id: str) -> None:
    path = Path(str(_run(_child_create_with_reaper_and_get_killed, engine_id,
                         exitcode=-signal.SIGKILL)))
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not path.exists()

def test_reaper_of_a_closed_region_is_gone_and_ignores_ctrl_c(engine_id: str) -> None:
    region = SlotRegion.create(engine_id, 2, 64, reaper=True)
    assert region._reaper is not None
    pid = region._reaper.pid
    time.sleep(0.2)  # once it runs
    os.kill(pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group
    time.sleep(0.2)
    assert _running(pid) and region.path.exists()
    region.close()
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid) and not region.path.exists()

def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)

def test_reaper_of_a_closed_region_spares_the_next_region_of_its_name(engine_id: str) -> None:
    # vLLM names a worker's region by engine id and rank: a region created
    # again under the name must survive the old region's reaper, however late
    # that one wakes (stopped here until the new region exists)
    name = f"kvtier-{engine_id}-rank0.slots"
    old = SlotRegion.create(engine_id, 2, 64, name=name, reaper=True)
    assert old._reaper is not None
    pid = old._reaper.pid
    os.kill(pid, signal.SIGSTOP)
    old.close()
    new = SlotRegion.create(engine_id, 2, 64, name=name)
    try:
        os.kill(pid, signal.SIGCONT)
        _wait_gone(pid)
        assert new.path.exists()
        SlotRegion.attach(name).close()
    finally:
        new.close()

def test_reaper_of_a_killed_creator_spares_a_new_region_of_its_name(engine_id: str) -> None:
    name = f"kvtier-{engine_id}-rank0.slots"
    q: mp.Queue = SPAWN.Queue()
    proc = SPAWN.Process(target=_child_create_with_reaper_and_wait, args=(name, q))
    proc.start()
    path, pid = q.get(timeout=60)
    os.kill(pid, signal.SIGSTOP)  # the reaper wakes only after the restart below
    proc.kill()
    proc.join(timeout=60)
    new = SlotRegion.create(engine_id, 2, 64, name=name)  # removes the stale file first
    try:
        assert str(new.path) == path
        os.kill(pid, signal.SIGCONT)
        _wait_gone(pid)
        assert new.path.exists()
    finally:
        new.close()

def _running(pid: int) -> bool:
    """Alive and not a zombie (an adopted reaper may wait for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

def test_region_with_reused_pid_is_stale(engine_id: str) -> None:
    # A header naming this (live) pid but another process start time: the pid
    # was reused, the creator is gone.
    header = RegionHeader(4096, 1, 64, 4096, os.getpid(), 1, engine_id)
    path = default_shm_dir() / f"kvtier-{engine_id}-fixed.slots"
    path.write_bytes(header.pack().ljust(8192, b"\0"))
    try:
        assert path in cleanup_stale_regions()
    finally:
        path.unlink(missing_ok=True)

def test_a_live_region_whose_pid_looks_dead_is_kept(engine_id: str) -> None:
    # Containers sharing /dev/shm but not a pid namespace: the creator's pid
    # names no process here, or another one. Its lock says it is alive.
    live = SlotRegion.create(engine_id, 2, 64)
    try:
        elsewhere = dataclasses.replace(live.header, creator_pid=os.getpid(),
                                        creator_start_ticks=1)
        with live.path.open("r+b") as f:
            f.write(elsewhere.pack())
        assert cleanup_stale_regions() == []
        assert live.path.exists()
    finally:
        live.close()
    assert not live.path.exists()


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("num_slots", "slot_bytes", "match"),
    [
        (0, 64, "num_slots must be a positive int"),
        (-3, 64, "num_slots must be a positive int"),
        (4, 0, "slot_bytes must be a positive int"),
        (4, -1, "slot_bytes must be a positive int"),
        (4, 6.5, "slot_bytes must be a positive int"),
        (True, 64, "num_slots must be a positive int"),
    ],
)
def test_bad_sizes_rejected(
    engine_id: str, num_slots: object, slot_bytes: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        SlotRegion.create(engine_id, num_slots, slot_bytes)  # type: ignore[arg-type]
    assert not (default_shm_dir() / region_name(engine_id)).exists()

def test_bad_alignment_and_oversize_rejected(engine_id: str) -> None:
    with pytest.raises(ValueError, match="power of two"):
        SlotRegion.create(engine_id, 4, 64, alignment=3000)
    with pytest.raises(MemoryError, match=r"needs .* bytes but"):
        SlotRegion.create(engine_id, 1 << 20, 1 << 30)
    assert not (default_shm_dir() / region_name(engine_id)).exists()

@pytest.mark.parametrize("slot_id", [-1, 8, 100])
def test_out_of_range_slot_ids_rejected(region: SlotRegion, slot_id: int) -> None:
    with pytest.raises(IndexError, match=f"slot id {slot_id} out of range .* 8 slots"):
        region.slot_array(slot_id)

def test_non_int_slot_id_rejected(region: SlotRegion) -> None:
    with pytest.raises(TypeError, match="slot id must be an int"):
        region.slot_array("1")  # type: ignore[arg-type]
    assert region.slot_array(np.int64(7)).shape == (5000,)


def test_a_zombie_creator_is_dead(engine_id: str) -> None:
    """A child that exited but was not reaped still has a pid: it holds nothing."""
    import subprocess

    from kvtier.slots.region import pid_alive

    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while not _is_zombie(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert _is_zombie(child.pid)
        assert not pid_alive(child.pid)
    finally:
        child.wait()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False
