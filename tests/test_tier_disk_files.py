"""The disk and ranked tiers on real files: block files of other names,
shards of another length, a failed rescan, a read dropping the shards of a
block a put is writing, writer threads sharing the free-space reserve,
directories others may write."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import disk_blocks
from helpers.disk_blocks import ROOT_ONLY, SIZE, payload

from kvtier import block_key
from kvtier.slots import SlotRegion
from kvtier.tiers import DiskTier, KVLayout, TierConfigError
from kvtier.tiers.disk_dir import LAYOUT_DIR, allocated, check_tier_path, fan_out_index
from kvtier.tiers.io_pool import PromotionJob
from kvtier.tiers.ranks import RankedTier, RankRegions
from kvtier.tools import disk_admin

NS = KVLayout("leftover-model", "bfloat16", 16, 2, 2, 64).namespace()


def file_bytes(size: int = SIZE) -> int:
    return disk_blocks.file_bytes(NS, size)


def make(path: Path, capacity: int = 64 << 20, ns: str = NS, **kw: Any) -> DiskTier:
    kw.setdefault("rescan_interval_s", None)
    return disk_blocks.make_disk(path, ns, capacity, **kw)


def ranked(path: Path, ranks: int = 2) -> tuple[RankedTier, list[DiskTier]]:
    return disk_blocks.ranked_disks(make, path, "leftover-model", ranks)


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[RankRegions]:
    yield from disk_blocks.rank_regions(tmp_path, "disk-leftover")


def fill(slot_parts: list[np.ndarray], seed: int) -> None:
    for r, part in enumerate(slot_parts):
        part[:] = payload(seed + r)


# ---------------------------------------------------------------- (1) other names


def test_block_files_of_other_names_are_neither_indexed_nor_passed_by_verify(
        tmp_path: Path) -> None:
    tier = make(tmp_path)
    keys = [block_key(0xABCDEF00 + i) for i in range(4)]  # hex names with letters
    assert tier.put([(k, payload(i)) for i, k in enumerate(keys)]) == [True] * 4
    upper = Path(tier.dir.file(keys[2]))  # a copied tree, a tool that upper-cased names
    upper = upper.rename(upper.with_name(keys[2].hex().upper() + ".kvb"))
    misplaced = Path(tier.dir.file(keys[3]))  # in another key's subdirectory
    other = misplaced.parent.parent / f"{(fan_out_index(keys[3]) + 1) % 256:02x}"
    misplaced = misplaced.rename(other / misplaced.name)
    tier.close()

    tier = make(tmp_path)  # the restart's scan
    # Before: both were indexed under their keys, whose files (the names the
    # tier gives them) do not exist: `contains` promised blocks every read
    # missed, `used_bytes` counted them, and evicting them removed nothing.
    assert tier.contains(keys) == [True, True, False, False]
    assert tier.stats()["blocks"] == 2
    assert tier.stats()["used_bytes"] == 2 * file_bytes()
    assert sorted(tier.indexed_keys()) == sorted(keys[:2])

    # The operator's tool reports both and removes them (before: the
    # upper-case one passed as a good block, and stayed forever).
    bad: list[str] = []
    _, selected = disk_admin.select(tmp_path)
    summary = disk_admin.verify_disk(selected, repair=True, on_bad=lambda b: bad.append(b.path))
    assert sorted(bad) == sorted([str(upper), str(misplaced)])
    assert summary.blocks == 4
    assert not upper.exists() and not misplaced.exists()


# ---------------------------------------------------------------- (2) shards of another length


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_shard_of_another_length_is_removed_once_found(
        tmp_path: Path, regions: RankRegions, bad_rank: int) -> None:
    tier, tiers = ranked(tmp_path)
    key = block_key(5)
    for r, rank_tier in enumerate(tiers):  # a valid file of half a shard on one rank
        rank_tier.put([(key, payload(50 + r, SIZE // 2 if r == bad_rank else SIZE))])
    assert tier.contains([key]) == [True]
    assert tier.get_into([key], [regions.slot_array(0)]) == [None]
    # Before: kept, so every lookup found the block and every promotion of
    # it missed (rank 0's shard: never dropped; rank 1's: "held", so kept).
    assert tier.contains([key]) == [False]
    assert [os.path.exists(t.dir.file(key)) for t in tiers] == [False, False]


def test_a_block_of_another_size_in_a_single_tier_is_removed_once_promoted(
        tmp_path: Path) -> None:
    disk = make(tmp_path / "disk")
    key = block_key(9)
    assert disk.put([(key, payload(9, SIZE // 2))]) == [True]
    with SlotRegion.create("disk-leftover-single", 2, SIZE, shm_dir=tmp_path) as region:
        job = PromotionJob([key], [0], [disk], started=time.monotonic())
        job.run(region)
        assert job.ok == [False]
    # Before: "ignored", so each later lookup promoted it again, in vain.
    assert disk.contains([key]) == [False]
    assert not os.path.exists(disk.dir.file(key))


# ---------------------------------------------------------------- (3) a failed rescan


def test_a_failed_rescan_hides_no_block_from_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)
    key = block_key(1)
    home = fan_out_index(key)
    assert tier.put([(key, payload(1))]) == [True]
    # A subdirectory replaced by a file: the scan fails (NotADirectoryError).
    broken = tier.root / f"{(home + 1) % 256:02x}"
    broken.rmdir()
    broken.write_bytes(b"")
    scan = tier._scan

    def scan_while_deleting() -> object:  # the block leaves while the scan runs
        assert tier.delete([key]) == 1
        return scan()

    monkeypatch.setattr(tier, "_scan", scan_while_deleting)
    with pytest.raises(NotADirectoryError):
        tier.rescan()
    monkeypatch.undo()
    broken.unlink()
    broken.mkdir(mode=0o700)

    assert tier.put([(key, payload(1))]) == [True]  # stored again in between
    tier.rescan()
    # Before: the failed scan's removed keys were kept, and this scan left the
    # block out: its file on disk, neither indexed nor counted.
    assert tier.indexed_keys() == [key]
    assert tier.stats()["used_bytes"] == file_bytes()
    assert tier.debug_state()["scan_removed"] == 0


# ---------------------------------------------------------------- (4) drop against put


def test_a_read_leaves_the_shards_of_a_put_running_alone(
        tmp_path: Path, regions: RankRegions, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, tiers = ranked(tmp_path)
    key = block_key(4)
    fill(regions.slot_array(0).parts, 40)
    entered, go = threading.Event(), threading.Event()
    put_rank_1 = tiers[1].put

    def slow_put(items: list[tuple[bytes, object]]) -> list[bool]:
        entered.set()  # rank 0's shard is written, rank 1's not yet
        assert go.wait(10)
        return put_rank_1(items)

    monkeypatch.setattr(tiers[1], "put", slow_put)
    result: list[list[bool]] = []
    writer = threading.Thread(target=lambda: result.append(tier.put([(key,
                                                                     regions.slot_array(0))])))
    writer.start()
    assert entered.wait(10)
    # a promotion reads the block meanwhile: rank 0 whole, rank 1 missing
    assert tier.get_into([key], [regions.slot_array(1)]) == [None]
    go.set()
    writer.join(10)
    assert result == [[True]]
    # Before: the read deleted rank 0's new shard; the put reported a block
    # that no read could serve, and left rank 1's shard orphaned.
    assert tier.contains([key]) == [True]
    assert tier.get_into([key], [regions.slot_array(2)]) == [2 * SIZE]
    assert all(np.array_equal(a, b) for a, b in zip(regions.slot_array(2).parts,
                                                   regions.slot_array(0).parts, strict=True))


def test_a_put_waits_for_a_read_dropping_the_shards_of_its_block(
        tmp_path: Path, regions: RankRegions, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, tiers = ranked(tmp_path)
    key = block_key(8)
    assert tiers[0].put([(key, payload(80))]) == [True]  # an orphan shard
    fill(regions.slot_array(0).parts, 81)
    checking, go = threading.Event(), threading.Event()
    ask_rank_1 = tiers[1].contains_waiting

    def slow_check(keys: list[bytes]) -> list[bool]:
        found = ask_rank_1(keys)  # not there: the drop will delete rank 0's shard
        checking.set()
        assert go.wait(10)
        return found

    monkeypatch.setattr(tiers[1], "contains_waiting", slow_check)
    reader = threading.Thread(target=tier.get_into, args=([key], [regions.slot_array(1)]))
    reader.start()
    assert checking.wait(10)
    result: list[list[bool]] = []
    writer = threading.Thread(target=lambda: result.append(tier.put([(key,
                                                                     regions.slot_array(0))])))
    writer.start()
    writer.join(0.5)  # before: done here, rank 0's orphan taken as its shard
    go.set()
    reader.join(10)
    writer.join(10)
    assert result == [[True]]
    # Before: the drop then deleted rank 0's shard under the finished put.
    assert tier.contains([key]) == [True]
    assert tier.get_into([key], [regions.slot_array(2)]) == [2 * SIZE]
    assert np.array_equal(regions.slot_array(2).parts[0], regions.slot_array(0).parts[0])


def test_a_put_failing_on_one_rank_leaves_the_shards_of_another_put_alone(
        tmp_path: Path, regions: RankRegions, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, tiers = ranked(tmp_path)
    key = block_key(7)
    fill(regions.slot_array(0).parts, 70)
    full = [True]  # rank 1's file system, full for the first put only
    tiers[1]._free_space = lambda _: 0 if full[0] else 1 << 40
    tiers[1].free_reserve_bytes = 1
    deleting, go = threading.Event(), threading.Event()
    delete_rank_0 = tiers[0].delete

    def slow_delete(keys: list[bytes]) -> int:
        deleting.set()  # the first put removes its orphan shard on rank 0
        assert go.wait(10)
        return delete_rank_0(keys)

    monkeypatch.setattr(tiers[0], "delete", slow_delete)
    results: dict[str, list[bool]] = {}

    def put(name: str) -> None:
        results[name] = tier.put([(key, regions.slot_array(0))])

    first = threading.Thread(target=put, args=("first",))
    first.start()
    assert deleting.wait(10)
    full[0] = False
    second = threading.Thread(target=put, args=("second",))
    second.start()
    second.join(0.5)  # before: done here, rank 0's shard taken as a duplicate
    go.set()
    first.join(10)
    second.join(10)
    assert results == {"first": [False], "second": [True]}
    # Before: the first put's orphan delete took the shard the second counted.
    assert tier.contains([key]) == [True]
    assert tier.get_into([key], [regions.slot_array(1)]) == [2 * SIZE]


# ---------------------------------------------------------------- (5) the free-space reserve


def test_writer_threads_keep_the_free_space_reserve_together(tmp_path: Path) -> None:
    threads, reserve = 4, 4 * file_bytes()
    total = reserve + file_bytes()  # room for one block above the reserve

    def free_now() -> int:  # a file system of `total` bytes holding only the tier's files
        used = sum(allocated(f.stat().st_size) for f in tmp_path.rglob("*") if f.is_file())
        return total - used

    # The threads read the free space together where they may (before: all
    # of them, each seeing room for its block); one at a time, each waits out
    # the timeout once.
    together = threading.Barrier(threads, timeout=0.5)

    def free(_: str) -> int:
        now = free_now()
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait()  # no thread writes before the others have read
        return now

    tier = make(tmp_path, 100 * file_bytes(), free_space=free, free_reserve_bytes=reserve)
    results: list[list[bool]] = []
    workers = [threading.Thread(target=lambda i=i: results.append(
                   tier.put([(block_key(i), payload(i))])))
               for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert len(results) == threads
    assert sum(r == [True] for r in results) >= 1
    # Before: every thread wrote its block, 3 blocks into the reserve.
    assert tier.stats()["no_space"] == sum(r == [False] for r in results)
    assert free_now() >= reserve
    assert tier.stats()["pending_bytes"] == 0


# ---------------------------------------------------------------- (6) directories others may write


def test_a_directory_others_may_write_above_disk_path_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"  # a container's shared volume: 0777, no sticky bit
    shared.mkdir()
    shared.chmod(0o777)
    # Before: accepted, as this user's (or root's): any user could rename the
    # tier's directory away and put a tree of its own files in its place.
    with pytest.raises(TierConfigError, match="writable by every user"):
        make(shared / "cache")
    with pytest.raises(TierConfigError, match="writable by every user"):
        check_tier_path(shared / "other")  # kvtier serve's check before vLLM starts
    with pytest.raises(TierConfigError, match="writable by every user"):
        make(shared)  # disk_path itself
    link = tmp_path / "link"  # and on the way to a symlink's target
    link.symlink_to(shared)
    with pytest.raises(TierConfigError, match="writable by every user"):
        make(link / "cache")
    shared.chmod(0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    tier = make(shared / "cache")
    assert tier.put([(block_key(1), payload(1))]) == [True]
    tier.close()
    shared.chmod(0o755)
    make(shared / "cache").close()
    assert (shared / "cache" / LAYOUT_DIR).is_dir()


@ROOT_ONLY
def test_a_directory_a_group_may_write_is_refused_unless_the_group_is_this_users(
        tmp_path: Path) -> None:
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o775)
    os.chown(team, 0, 12345)  # root's, writable by group 12345
    with pytest.raises(TierConfigError, match="writable by group 12345"):
        make(team / "cache")
    os.chown(team, 0, 0)  # root's own group (user private group of root)
    make(team / "cache").close()

