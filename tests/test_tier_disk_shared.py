"""The disk tier and the ranked tier, on real files and real processes:
another user's directories, clocks set back, space freed by another engine,
empty files after a crash, writers sharing a pid, kills mid-write, shards."""

from __future__ import annotations

import fcntl
import itertools
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import disk_blocks
from helpers.disk_blocks import ROOT_ONLY, SIZE, payload
from test_tier_disk import hang_stats_under

from kvtier import block_key
from kvtier.tiers import DiskTier, KVLayout, TierConfigError, blockfile
from kvtier.tiers.disk_dir import ALLOC_UNIT, LAYOUT_DIR, allocated, check_tier_path
from kvtier.tiers.ranks import RankedTier, RankRegions

NS = KVLayout("review-model", "bfloat16", 16, 2, 2, 64).namespace()


def file_bytes(size: int = SIZE) -> int:
    return disk_blocks.file_bytes(NS, size)


def make(path: Path, capacity: int = 64 << 20, ns: str = NS, **kw: Any) -> DiskTier:
    return disk_blocks.make_disk(path, ns, capacity, **kw)


def held_ids(tier: DiskTier) -> set[int]:
    return {int.from_bytes(k[:8], "big") for k in tier.indexed_keys()}


# ---------------------------------------------------------------- another user


@ROOT_ONLY
def test_a_disk_path_another_user_owns_is_refused(tmp_path: Path) -> None:
    # Another user made the directory first (in /tmp, say): it may rename the
    # tier's 0700 directories away and plant its own files, which would be served.
    theirs = tmp_path / "kvtier-disk"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(TierConfigError, match="uid 12345"):
        make(theirs)
    with pytest.raises(TierConfigError, match="uid 12345"):
        make(theirs / "below" / "it")  # missing directories under it, too
    with pytest.raises(TierConfigError, match="uid 12345"):
        check_tier_path(theirs / "cache")  # kvtier serve's check before vLLM starts
    assert not (theirs / LAYOUT_DIR).exists()
    # A symlink of theirs to a directory of ours: they could point it elsewhere later.
    ours = tmp_path / "ours"
    ours.mkdir()
    link = tmp_path / "link"
    link.symlink_to(ours)
    os.lchown(link, 12345, 12345)
    with pytest.raises(TierConfigError, match="uid 12345"):
        make(link)
    os.lchown(link, 0, 0)
    make(link).close()  # this user's (root's) symlink is followed


def test_a_directory_of_this_user_is_used(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o777)  # this user's, under this user's and root's: accepted
    tier = make(ours)
    key = block_key(7)
    assert tier.put([(key, payload(7))]) == [True]
    buf = np.zeros(SIZE, np.uint8)
    assert tier.get_into([key], [buf]) == [SIZE] and np.array_equal(buf, payload(7))


# ---------------------------------------------------------------- clock set back


def test_blocks_dated_in_the_future_do_not_outlive_the_blocks_in_use(tmp_path: Path) -> None:
    cap = 4 * file_bytes()
    tier = make(tmp_path, cap, rescan_interval_s=None)
    tier.put([(block_key(i), payload(i)) for i in range(4)])
    tier.close()
    tomorrow = time.time() + 86_400  # written, then the clock was set back a day
    for i in range(4):
        os.utime(tier.dir.file(block_key(i)), (tomorrow, tomorrow))
    tier = make(tmp_path, cap, rescan_interval_s=None)  # the restart's scan
    for i in range(10, 16):  # blocks in use since, each rescanned after its store
        assert tier.put([(block_key(i), payload(i))]) == [True]
        tier.rescan()
    # Before: the scan's order put tomorrow's blocks last, every rescan, so each
    # new block evicted the one before it and the tier held {1, 2, 3, 15}.
    assert held_ids(tier) == {12, 13, 14, 15}
    for key in tier.indexed_keys():
        assert os.stat(tier.dir.file(key)).st_mtime <= time.time() + 1


# ---------------------------------------------------------------- free-space reserve


def test_the_free_space_reserve_holds_after_another_engine_removed_indexed_blocks(
        tmp_path: Path) -> None:
    total, reserve = 12 * file_bytes(), 4 * file_bytes()

    def free(_: str) -> int:  # a file system of `total` bytes holding only the tiers' files
        used = sum(allocated(f.stat().st_size) for f in tmp_path.rglob("*") if f.is_file())
        return total - used

    a = make(tmp_path, 100 * file_bytes(), free_space=free, free_reserve_bytes=reserve,
             rescan_interval_s=None)
    b = make(tmp_path, 100 * file_bytes(), free_space=free, free_reserve_bytes=reserve,
             rescan_interval_s=None)
    assert a.put([(block_key(i), payload(i)) for i in range(4)]) == [True] * 4
    assert b.delete([block_key(i) for i in range(4)]) == 4  # a's index is stale now
    assert b.put([(block_key(i), payload(i)) for i in range(10, 18)]) == [True] * 8
    assert free("") == reserve
    # a needs one block of room: evicting its stale entries frees nothing.
    assert a.put([(block_key(20), payload(20))]) == [False]
    assert free("") >= reserve  # before: a wrote into the reserve
    assert a.stats()["no_space"] == 1 and a.stats()["blocks"] == 0


# ---------------------------------------------------------------- empty files after a crash


def test_empty_block_files_count_toward_the_index_bound(tmp_path: Path) -> None:
    # An OS crash without fsync leaves renamed block files empty.
    cap = 8 * ALLOC_UNIT
    make(tmp_path, cap).close()
    tier = make(tmp_path, cap)
    for i in range(50):
        Path(tier.dir.file(block_key(i))).touch()
    tier.close()
    tier = make(tmp_path, cap)
    # Before: each counted 0 bytes, and the index held all 50 (its bound: 8).
    assert tier.debug_state()["index"] <= cap // ALLOC_UNIT
    assert tier.stats()["used_bytes"] <= cap


# ---------------------------------------------------------------- writers sharing a pid


def test_the_temp_file_of_another_writer_with_this_pid_is_left_alone(tmp_path: Path) -> None:
    # An engine in another container has this pid, and writes the same block
    # with the same serial: the temp name is the same.
    tier = make(tmp_path)
    tier._tmp_serial = itertools.count(7)
    key = block_key(3)
    theirs = tier.dir.temp_file(key, 7)
    fd = os.open(theirs, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert tier.put([(key, payload(3))]) == [False]  # dropped, not written over
        assert os.path.exists(theirs)  # before: removed, and their rename failed
        os.write(fd, blockfile.encode(NS.encode(), key, payload(3)))
        os.rename(theirs, tier.dir.file(key))
    finally:
        os.close(fd)
    assert bytes(tier.get([key])[0]) == payload(3).tobytes()  # type: ignore[arg-type]


def test_temp_names_differ_between_tiers_of_one_pid(tmp_path: Path) -> None:
    a, b = make(tmp_path), make(tmp_path)
    assert a.dir.temp_file(block_key(1), next(a._tmp_serial)) != \
        b.dir.temp_file(block_key(1), next(b._tmp_serial))


# ---------------------------------------------------------------- real processes


def _write_forever_before_rename(path: str, ready: mp.Event) -> None:  # type: ignore[valid-type]
    """A writer killed between its write and its rename."""
    def stall(*_: object) -> None:
        ready.set()
        time.sleep(600)

    os.rename = stall  # type: ignore[assignment]
    make(Path(path)).put([(block_key(1), payload(1))])


def test_a_writer_killed_before_its_rename_leaves_nothing_served(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_write_forever_before_rename, args=(str(tmp_path), ready))
    proc.start()
    try:
        assert ready.wait(60)
        temps = list(tmp_path.rglob(".*.tmp"))
        assert len(temps) == 1 and temps[0].stat().st_size > SIZE
    finally:
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(30)
    tier = make(tmp_path)  # the restart's scan: the dead writer's temp file goes
    assert list(tmp_path.rglob(".*.tmp")) == []
    assert tier.contains([block_key(1)]) == [False] and tier.get([block_key(1)]) == [None]


def _hammer(path: str, seed: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Store, read, delete and rescan the same keys as another process; count bad reads."""
    tier = make(Path(path), 6 * file_bytes(), rescan_interval_s=0.05)
    rng = np.random.default_rng(seed)
    bad = hits = 0
    buf = np.zeros(SIZE, np.uint8)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = int(rng.integers(0, 12))
        op = rng.random()
        if op < 0.45:
            tier.put([(block_key(i), payload(i))])
        elif op < 0.9:
            if tier.get_into([block_key(i)], [buf]) == [SIZE]:
                hits += 1
                bad += not np.array_equal(buf, payload(i))
        elif op < 0.95:
            tier.delete([block_key(i)])
        else:
            tier.rescan()
    s = tier.stats()
    out.put((bad, hits, s["corrupt"], s["errors"]))


def test_two_processes_storing_reading_and_evicting_the_same_keys(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), s, 2.0, out)) for s in (1, 2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(bad == 0 and corrupt == 0 and errors == 0 for bad, _, corrupt, errors in results)
    assert sum(hits for _, hits, _, _ in results) > 0
    assert list(tmp_path.rglob(".*.tmp")) == []
    # the directory within both engines' capacity (each bounds it after its rescans)
    on_disk = sum(allocated(f.stat().st_size) for f in tmp_path.rglob("*.kvb"))
    assert on_disk <= 2 * 6 * file_bytes()


# ---------------------------------------------------------------- ranked tier


def _ranked(tmp_path: Path, ranks: int = 2) -> tuple[RankedTier, list[DiskTier]]:
    return disk_blocks.ranked_disks(make, tmp_path, "review-model", ranks)


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[RankRegions]:
    yield from disk_blocks.rank_regions(tmp_path, "disk-review")


def test_a_shard_of_another_length_fails_the_block(tmp_path: Path, regions: RankRegions) -> None:
    ranked, tiers = _ranked(tmp_path / "disk")
    key = block_key(5)
    tiers[0].put([(key, payload(50))])
    tiers[1].put([(key, payload(51, SIZE // 2))])  # valid file, half a shard
    slot = regions.slot_array(0)
    assert ranked.get_into([key], [slot]) == [None]
    assert ranked.stats()["hits"] == 0


def test_a_put_one_rank_cannot_store_leaves_no_block_to_serve(
        tmp_path: Path, regions: RankRegions) -> None:
    ranked, tiers = _ranked(tmp_path / "disk")
    tiers[1]._free_space = lambda _: 0  # rank 1's file system is full
    tiers[1].free_reserve_bytes = 1
    key = block_key(6)
    for r, part in enumerate(regions.slot_array(1).parts):
        part[:] = payload(60 + r)
    assert ranked.put([(key, regions.slot_array(1))]) == [False]
    assert [t.contains([key]) for t in tiers] == [[False], [False]]
    # a restart of both ranks finds no shard of it either
    again, _ = _ranked(tmp_path / "disk")
    assert again.contains([key]) == [False]
    assert again.get_into([key], [regions.slot_array(2)]) == [None]


def test_a_hung_file_system_costs_a_ranked_lookup_one_timeout_not_one_per_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A lost network mount under a TP=4 engine: every rank's lookup of a block
    # another engine wrote waits on its stat (a fault no real file system gives
    # on demand). The scheduler's wait is bounded by one lookup_timeout_s.
    ranks, timeout = 4, 0.2
    layouts = [KVLayout("review-model", "bfloat16", 16, 2, 2, 64, tp_rank=r, tp_size=ranks)
               for r in range(ranks)]
    ranked = RankedTier([make(tmp_path, ns=lay.namespace(), lookups="thread",
                              lookup_timeout_s=timeout) for lay in layouts])
    writer = [make(tmp_path, ns=lay.namespace()) for lay in layouts]  # another engine
    for r, tier in enumerate(writer):
        tier.put([(block_key(1), payload(10 + r))])
    release = hang_stats_under(monkeypatch, tmp_path)
    try:
        started = time.monotonic()
        assert ranked.contains([block_key(1), block_key(2)]) == [False, False]
        waited = time.monotonic() - started
    finally:
        release.set()
    assert waited < 2 * timeout  # before: 4 x 0.2 s, one timeout per rank
    deadline = time.monotonic() + 10  # the file system answers again: found
    while ranked.contains([block_key(1)]) != [True]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ranked.contains([block_key(2)]) == [False]


@ROOT_ONLY
def test_a_foreign_symlink_between_two_of_ours_is_refused(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    ours.mkdir()
    (tmp_path / "theirs").symlink_to(ours)
    os.lchown(tmp_path / "theirs", 12345, 12345)  # they may point it elsewhere later
    (tmp_path / "mine").symlink_to("theirs")
    with pytest.raises(TierConfigError, match="uid 12345"):
        make(tmp_path / "mine" / "cache")
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(TierConfigError):
        make(tmp_path / "loop")
