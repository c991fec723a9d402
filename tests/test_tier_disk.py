"""DiskTier on real files: round trip, corruption, crashes, space, restarts, sharing."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import block_key
from kvtier.slots import SlotRegion
from kvtier.tiers import DiskTier, KVLayout, TierConfigError
from kvtier.tiers.disk_dir import ALLOC_UNIT, LAYOUT_DIR, MANIFEST_NAME
from kvtier.tiers.disk_lookups import file_system_type, may_hang

NS = KVLayout("test-model", "bfloat16", 16, 2, 2, 64).namespace()
OTHER_NS = KVLayout("test-model", "float16", 16, 2, 2, 64).namespace()
SIZE = 64 * 1024
WORKER = str(Path(__file__).parent / "helpers" / "tier_worker.py")
REPO = str(Path(__file__).parent.parent)


def payload(i: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def file_bytes(size: int = SIZE) -> int:
    """Accounted bytes of one block file (header + payload, 4 KiB rounded)."""
    return -(-(size + 200) // ALLOC_UNIT) * ALLOC_UNIT


def make(path: Path, capacity: int = 64 << 20, **kw: object) -> DiskTier:
    kw.setdefault("free_reserve_bytes", 0)
    kw.setdefault("enable_events", True)
    return DiskTier(path, NS, capacity, **kw)  # type: ignore[arg-type]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.tmp"))


def run_worker(role: str, **cfg: object) -> dict:
    out = subprocess.run(
        [sys.executable, WORKER, role, json.dumps(cfg)], capture_output=True, text=True,
        timeout=120, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ---------------------------------------------------------------- basics
def test_round_trip_through_slot_region(tmp_path: Path) -> None:
    tier = make(tmp_path / "cache")
    keys = [block_key(i) for i in range(4)]
    with SlotRegion.create("disk-test", 8, SIZE, shm_dir=tmp_path) as region:
        for i in range(4):
            region.slot_array(i)[:] = payload(i)
        assert tier.put([(k, region.slot_array(i)) for i, k in enumerate(keys)]) == [True] * 4
        assert tier.contains([*keys, block_key(99)]) == [True] * 4 + [False]
        got = tier.get_into(keys, [region.slot_array(4 + i) for i in range(4)])
        assert got == [SIZE] * 4
        for i in range(4):
            assert np.array_equal(region.slot_array(4 + i), payload(i))
    assert bytes(tier.get([keys[0]])[0]) == payload(0).tobytes()  # type: ignore[arg-type]
    assert tier.get([block_key(99)]) == [None]
    s = tier.stats()
    assert (s["hits"], s["misses"], s["stores"], s["blocks"]) == (5, 1, 4, 4)
    assert s["used_bytes"] == 4 * file_bytes()
    events = tier.take_events()
    assert [(e.kind, len(e.keys)) for e in events] == [("stored", 4)]
    assert events[0].as_event() is not None and events[0].as_event().medium == "DISK"


def test_private_permissions_and_layout(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        tier = make(tmp_path / "cache")
        tier.put([(block_key(1), payload(1))])
    finally:
        os.umask(old)
    root = tmp_path / "cache" / LAYOUT_DIR / NS
    assert tier.root == root
    for d in [root.parent, root, *[p for p in root.iterdir() if p.is_dir()]]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    (f,) = block_files(root)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert f.name == block_key(1).hex() + ".kvb"


def test_manifest_is_written_once_private_and_not_a_block(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        tier = make(tmp_path / "cache", manifest={"model": "m-1", "rank": 0})
    finally:
        os.umask(old)
    manifest = tier.root / MANIFEST_NAME
    assert json.loads(manifest.read_text()) == {"model": "m-1", "rank": 0}
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    tier.close()
    again = make(tmp_path / "cache", manifest={"model": "m-2"})  # the first one stays
    assert json.loads(manifest.read_text())["model"] == "m-1"
    assert again.stats()["blocks"] == 0 and not temp_files(again.root)


def test_no_duplicate_writes(tmp_path: Path) -> None:
    tier = make(tmp_path)
    key = block_key(7)
    assert tier.put([(key, payload(7))]) == [True]
    (f,) = block_files(tmp_path)
    inode = f.stat().st_ino
    assert tier.put([(key, payload(7)), (key, payload(7))]) == [True, True]
    assert f.stat().st_ino == inode
    assert tier.stats()["stores"] == 1 and tier.stats()["duplicates"] == 2


def test_namespaces_do_not_mix(tmp_path: Path) -> None:
    make(tmp_path).put([(block_key(1), payload(1))])
    other = DiskTier(tmp_path, OTHER_NS, 1 << 20, free_reserve_bytes=0)
    assert other.contains([block_key(1)]) == [False]
    assert other.get([block_key(1)]) == [None]
    # A file planted under the wrong namespace's directory is rejected by its header.
    src = block_files(tmp_path / LAYOUT_DIR / NS)[0]
    dst = other.dir.file(block_key(1))
    shutil.copy(src, dst)
    assert other.get([block_key(1)]) == [None]
    assert other.stats()["corrupt"] == 1 and not os.path.exists(dst)


# ---------------------------------------------------------------- damage
@pytest.mark.parametrize("where", ["payload", "header", "key"])
def test_flipped_byte_is_a_miss_and_the_file_is_removed(tmp_path: Path, where: str) -> None:
    tier = make(tmp_path)
    key = block_key(3)
    tier.put([(key, payload(3)), (block_key(4), payload(4))])
    path = Path(tier.dir.file(key))
    raw = bytearray(path.read_bytes())
    offset = {"payload": len(raw) - 100, "header": 20, "key": 40 + len(NS) + 2}[where]
    raw[offset] ^= 0x40
    path.write_bytes(raw)
    tier.take_events()
    buf = np.zeros(SIZE, np.uint8)
    assert tier.get_into([key, block_key(4)], [buf, np.zeros(SIZE, np.uint8)]) == [None, SIZE]
    assert not path.exists()
    assert tier.contains([key]) == [False]
    s = tier.stats()
    assert (s["corrupt"], s["misses"], s["hits"], s["blocks"]) == (1, 1, 1, 1)
    (event,) = tier.take_events()
    assert event.kind == "corrupt" and event.keys == (key,) and "mismatch" in event.detail
    assert event.as_event().kind == "removed"  # type: ignore[union-attr]


@pytest.mark.parametrize("keep", [0, 30, 100, SIZE])
def test_truncated_file_is_a_miss(tmp_path: Path, keep: int) -> None:
    tier = make(tmp_path)
    key = block_key(5)
    tier.put([(key, payload(5))])
    path = Path(tier.dir.file(key))
    os.truncate(path, keep)
    assert tier.get([key]) == [None]
    assert not path.exists()
    assert tier.stats()["corrupt"] == 1


def test_buffer_too_small_is_a_miss(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put([(block_key(1), payload(1))])
    assert tier.get_into([block_key(1)], [np.zeros(SIZE - 1, np.uint8)]) == [None]
    assert tier.stats()["corrupt"] == 1


def test_block_removed_by_someone_else_is_a_miss(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put([(block_key(1), payload(1))])
    tier.take_events()
    os.unlink(tier.dir.file(block_key(1)))
    assert tier.get([block_key(1)]) == [None]
    assert tier.stats()["blocks"] == 0 and tier.stats()["corrupt"] == 0
    assert [(e.kind, e.detail) for e in tier.take_events()] == [("removed", "gone")]


@pytest.mark.parametrize("damage", ["gone", "corrupt"])
def test_a_store_made_while_a_read_fails_stays_indexed(
        tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The interleaving that a clean-clone run once met with four threads
    # (test_threads_share_one_tier: 13 files, 12 indexed): a read finds the
    # file gone or bad, another thread stores the key again, then the read
    # updates the index. It used to forget the new store, leaving its file in
    # no index and its bytes outside the capacity.
    tier = make(tmp_path)
    key = block_key(1)
    tier.put([(key, payload(1))])
    path = tier.dir.file(key)
    if damage == "gone":
        os.unlink(path)
        hook = "_miss"
    else:
        raw = bytearray(Path(path).read_bytes())
        raw[-1] ^= 1
        Path(path).write_bytes(raw)
        hook = "_corrupt"
    failed_read = getattr(tier, hook)

    def store_again_first(*args: object, **kw: object) -> object:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the bad file, as another thread's eviction would
        assert tier.put([(key, payload(1))]) == [True]
        return failed_read(*args, **kw)

    monkeypatch.setattr(tier, hook, store_again_first)
    assert tier.get([key]) == [None]
    monkeypatch.undo()
    s = tier.stats()
    assert s["blocks"] == len(block_files(tmp_path)) == 1
    assert s["used_bytes"] == file_bytes()
    got = tier.get([key])[0]
    assert got is not None and bytes(got) == payload(1).tobytes()


def test_a_read_that_fails_is_a_miss_counted_as_an_error(tmp_path: Path) -> None:
    # what the KvtierTierErrors alert (docs/prometheus-kvtier-alerts.yaml) reads:
    # a disk tier has no breaker, so failed reads show only in ``errors``
    tier = make(tmp_path)
    tier.put([(block_key(1), payload(1))])
    path = tier.dir.file(block_key(1))
    os.unlink(path)
    os.mkdir(path)  # opens, and every read of it fails (EISDIR)
    for _ in range(2):
        assert tier.get([block_key(1)]) == [None]
    s = tier.stats()
    assert s["errors"] == 2 and s["corrupt"] == 0 and tier.serving


def test_leftover_temp_files_are_ignored_and_cleaned(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put([(block_key(1), payload(1))])
    sub = Path(tier.dir.subdir(block_key(2)))
    probe = subprocess.Popen(["true"])  # its pid is one that has exited
    probe.wait()
    half = payload(2).tobytes()[: SIZE // 2]
    dead_tmp = sub / f".{block_key(2).hex()[:32]}.{probe.pid}.0.tmp"
    dead_tmp.write_bytes(half)  # a writer killed mid-write
    live_tmp = sub / f".{block_key(3).hex()[:32]}.{os.getpid()}.99.tmp"
    live_tmp.write_bytes(half)  # a write in progress in a live process
    old_tmp = sub / f".{block_key(4).hex()[:32]}.{os.getpid()}.98.tmp"
    old_tmp.write_bytes(half)
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    # a writer in another container: its pid means nothing here, its lock does
    foreign_tmp = sub / f".{block_key(5).hex()[:32]}.{probe.pid}.7.tmp"
    foreign_tmp.write_bytes(half)
    with open(foreign_tmp, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        again = make(tmp_path)
        assert foreign_tmp.exists()
    assert again.stats()["blocks"] == 1
    assert again.contains([block_key(2), block_key(3), block_key(4)]) == [False] * 3
    assert not dead_tmp.exists() and not old_tmp.exists()
    assert live_tmp.exists()
    assert again.stats()["tmp_removed"] == 2
    assert again.get([block_key(1)])[0] is not None


# ---------------------------------------------------------------- capacity and space
def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity=4 * file_bytes())
    keys = [block_key(i) for i in range(6)]
    tier.put([(k, payload(i)) for i, k in enumerate(keys[:4])])
    assert tier.get([keys[0]])[0] is not None  # 0 is now the most recent
    tier.take_events()
    assert tier.put([(keys[4], payload(4)), (keys[5], payload(5))]) == [True, True]
    assert tier.contains(keys) == [True, False, False, True, True, True]
    s = tier.stats()
    assert s["evictions"] == 2 and s["used_bytes"] <= s["capacity_bytes"]
    assert len(block_files(tmp_path)) == 4
    removed = [e for e in tier.take_events() if e.kind == "removed"]
    assert {k for e in removed for k in e.keys} == {keys[1], keys[2]}
    assert all(e.detail == "evicted" for e in removed)


def test_lookups_and_stats_do_not_wait_for_a_writer_holding_the_lock(tmp_path: Path) -> None:
    # A writer holds the tier's lock while it unlinks evicted files, which a
    # slow disk makes long; contains() and stats() run on the scheduler's thread,
    # and so does finding a block another engine wrote (inline lookups).
    tier = make(tmp_path, lookups="inline")
    keys = [block_key(i) for i in range(4)]
    tier.put([(k, payload(i)) for i, k in enumerate(keys[:2])])
    make(tmp_path).put([(keys[3], payload(3))])  # another engine's block
    answers: list[object] = []

    def scheduler() -> None:
        answers.append(tier.contains(keys))
        answers.append(tier.stats()["blocks"])
        answers.append(tier.debug_state()["index"])

    with tier._lock:  # the writer, stuck in an unlink
        thread = threading.Thread(target=scheduler, daemon=True)
        thread.start()
        thread.join(timeout=10)
        done = not thread.is_alive()
    thread.join(timeout=10)
    assert done, "the lookup waited for the lock"
    assert answers == [[True, True, False, True], 2, 2]
    assert tier.contains(keys[3:]) == [True] and tier.stats()["discovered"] == 1  # indexed now


def test_block_larger_than_capacity_is_dropped(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity=ALLOC_UNIT * 4)
    assert tier.put([(block_key(1), payload(1))]) == [False]
    assert tier.stats()["dropped_stores"] == 1


def test_fake_full_disk_drops_stores(tmp_path: Path) -> None:
    free = {"bytes": 0}
    tier = make(tmp_path, free_reserve_bytes=1 << 20, free_space=lambda _: free["bytes"])
    assert tier.put([(block_key(1), payload(1))]) == [False]
    s = tier.stats()
    assert (s["dropped_stores"], s["no_space"], s["stores"]) == (1, 1, 0)
    assert block_files(tmp_path) == [] and temp_files(tmp_path) == []
    # Enough room: stores again; then the disk fills up (someone else's data):
    # the tier gives back its own least recently used blocks to keep the reserve.
    free["bytes"] = 100 << 20
    assert tier.put([(block_key(i), payload(i)) for i in range(4)]) == [True] * 4
    free["bytes"] = (1 << 20) + file_bytes()  # exactly one more block over the reserve
    assert tier.put([(block_key(9), payload(9))]) == [True]
    assert tier.stats()["evictions"] == 0
    free["bytes"] = (1 << 20) + file_bytes() - 1  # short by one byte: one block goes
    assert tier.put([(block_key(10), payload(10))]) == [True]
    assert tier.stats()["evictions"] == 1
    assert tier.contains([block_key(0)]) == [False]


_TMPFS_CHILD = r"""
import json, os, sys
import numpy as np
from kvtier import block_key
from kvtier.tiers import DiskTier
d, ns = sys.argv[1], sys.argv[2]
MB = 1 << 20
blocks = [(block_key(i), np.full(MB, i, np.uint8)) for i in range(12)]
# 1. A free-space probe that lies: the writes themselves hit the real ENOSPC.
t = DiskTier(d + "/a", ns, 64 * MB, free_reserve_bytes=0, free_space=lambda p: 1 << 40)
ok = [t.put([b])[0] for b in blocks]
readable = [t.get_into([k], [np.zeros(MB, np.uint8)])[0] == MB for k, _ in blocks]
tmp_left = [f for _, _, fs in os.walk(d) for f in fs if f.endswith(".tmp")]
enospc = dict(ok=ok, readable=readable, tmp_left=tmp_left, stats=t.stats())
t.delete([k for k, _ in blocks])
# 2. The real statvfs with a 2 MiB reserve, then another program fills the disk.
def free():
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize
t2 = DiskTier(d + "/b", ns, 64 * MB, free_reserve_bytes=2 * MB)
ok2, free_min = [], free()
for b in blocks:
    ok2.append(t2.put([b])[0])
    free_min = min(free_min, free())
before = t2.stats()["blocks"]
with open(d + "/filler", "wb") as f:
    f.write(b"x" * (3 * MB // 2))
ok2.append(t2.put([(block_key(100), np.zeros(MB, np.uint8))])[0])
reserve = dict(ok=ok2, free_min=free_min, free_after=free(), blocks_before=before,
               stats=t2.stats())
print(json.dumps({"enospc": enospc, "reserve": reserve}))
"""


def run_on_private_tmpfs(tmp_path: Path, child: str) -> Any:
    """Run the Python ``child`` with arguments (an 8 MiB tmpfs mounted in a
    private mount namespace, root or user ns; ``NS``) and return the JSON it
    prints; skips where no such tmpfs can be mounted."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        cmd.insert(1, "--map-root-user")
    script = 'mount -t tmpfs -o size=8m kvtier-test "$1" && exec "$2" -c "$3" "$1" "$4"'
    out = subprocess.run(
        [*cmd, "sh", "-c", script, "sh", str(mnt), sys.executable, child, NS],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )
    if out.returncode != 0 and "mount" in out.stderr and "Traceback" not in out.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    return res


def test_enospc_on_a_small_tmpfs(tmp_path: Path) -> None:
    """A real 8 MiB tmpfs, mounted in a private mount namespace (root or user ns)."""
    res = run_on_private_tmpfs(tmp_path, _TMPFS_CHILD)
    enospc = res["enospc"]
    first_fail = enospc["ok"].index(False)
    assert 3 <= first_fail < 12
    assert enospc["readable"] == enospc["ok"]  # what was stored is served; nothing else
    assert enospc["tmp_left"] == []
    assert enospc["stats"]["no_space"] >= 1
    assert enospc["stats"]["dropped_stores"] == enospc["ok"].count(False)
    reserve = res["reserve"]
    assert all(reserve["ok"])  # the tier made room by evicting its own blocks
    assert reserve["free_min"] >= 2 << 20 and reserve["free_after"] >= 2 << 20
    assert reserve["stats"]["blocks"] < reserve["blocks_before"]
    assert reserve["stats"]["evictions"] > 0


_UNMOUNT_CHILD = r"""
import json, os, subprocess, sys
import numpy as np
from kvtier import block_key
from kvtier.tiers import DiskTier
d, ns = sys.argv[1], sys.argv[2]
t = DiskTier(d + "/cache", ns, 64 << 20, free_reserve_bytes=0)
before = t.put([(block_key(1), np.ones(1 << 20, np.uint8))])
subprocess.run(["umount", d], check=True)  # the cache disk goes away while serving
after = t.put([(block_key(2), np.ones(1 << 20, np.uint8))])
left = [os.path.join(r, f) for r, ds, fs in os.walk(d) for f in fs + ds]
print(json.dumps(dict(before=before, after=after, left=left, got=t.get([block_key(1)]) == [None],
                      dropped=t.stats()["dropped_stores"])))
"""


def test_an_unmounted_cache_disk_is_not_refilled_on_the_disk_below(tmp_path: Path) -> None:
    """A real tmpfs as the cache disk, unmounted while serving: the tier must not
    recreate its tree on the file system below (the root disk), which its
    capacity and free-space reserve were not sized for."""
    res = run_on_private_tmpfs(tmp_path, _UNMOUNT_CHILD)
    assert res["before"] == [True] and res["after"] == [False] and res["got"]
    assert res["left"] == [] and res["dropped"] == 1


# ---------------------------------------------------------------- restarts and sharing
def test_warm_restart_across_processes(tmp_path: Path) -> None:
    cfg = {"path": str(tmp_path), "namespace": NS, "capacity": 64 << 20, "size": SIZE}
    res = run_worker("disk-write", ids=list(range(20)), **cfg)
    assert res["stored"] == 20
    tier = make(tmp_path)
    assert tier.stats()["blocks"] == 20
    bufs = [np.zeros(SIZE, np.uint8) for _ in range(20)]
    assert tier.get_into([block_key(i) for i in range(20)], bufs) == [SIZE] * 20
    assert all(np.array_equal(b, payload(i)) for i, b in enumerate(bufs))
    assert tier.stats()["hits"] == 20


def test_restart_with_smaller_capacity_trims_oldest(tmp_path: Path) -> None:
    tier = make(tmp_path)
    for i in range(6):
        tier.put([(block_key(i), payload(i))])
        os.utime(tier.dir.file(block_key(i)), (1000 + i, 1000 + i))
    small = make(tmp_path, capacity=3 * file_bytes())
    assert small.contains([block_key(i) for i in range(6)]) == [False] * 3 + [True] * 3
    assert len(block_files(tmp_path)) == 3


def test_rebuild_is_fast_for_many_files(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity=1 << 40)
    n = 5000
    for start in range(0, n, 500):
        tier.put([(block_key(i), b"x" * 64) for i in range(start, start + 500)])
    started = time.perf_counter()
    again = make(tmp_path, capacity=1 << 40)
    elapsed = time.perf_counter() - started
    assert again.stats()["blocks"] == n
    assert elapsed < 5.0, f"rebuild of {n} files took {elapsed:.2f} s"


@pytest.mark.parametrize("lookups", ["inline", "thread"])
def test_blocks_of_another_engine_are_found(tmp_path: Path, lookups: str) -> None:
    a, b = make(tmp_path), make(tmp_path, lookups=lookups)
    a.put([(block_key(1), payload(1))])
    assert b.contains([block_key(1)]) == [True]
    assert b.stats()["discovered"] == 1
    assert bytes(b.get([block_key(1)])[0]) == payload(1).tobytes()  # type: ignore[arg-type]
    a.put([(block_key(2), payload(2))])
    assert b.get([block_key(2)])[0] is not None  # found by get as well


def test_a_fifo_at_a_block_path_is_a_miss_and_stays(tmp_path: Path) -> None:
    # a plain open of a FIFO waits for a writer: an I/O thread would hang on it
    t = make(tmp_path)
    t.put([(block_key(1), payload(1))])
    path = Path(t.dir.file(block_key(2)))
    os.mkfifo(path)
    got: list[object] = []
    reader = threading.Thread(
        target=lambda: got.append(t.get_into([block_key(2)], [bytearray(SIZE)])), daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # unblock the open so the thread ends
        with open(path, "wb"):
            pass
        pytest.fail("reading a block path holding a FIFO hung")
    assert got == [[None]] and stat.S_ISFIFO(path.lstat().st_mode)
    assert t.get_into([block_key(1)], [bytearray(SIZE)]) == [SIZE]


def hang_stats_under(monkeypatch: pytest.MonkeyPatch, root: Path) -> threading.Event:
    """Make every ``os.stat`` under ``root`` block until the returned event is
    set (a lost network mount: a fault no real file system gives on demand)."""
    release, real_stat = threading.Event(), os.stat

    def stat_that_hangs(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(root)):
            release.wait(30)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat_that_hangs)
    return release


def test_a_hung_lookup_costs_its_timeout_once(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A lost network mount: every stat under the directory blocks until released
    # (a fault no real file system gives on demand).
    a, b = make(tmp_path), make(tmp_path, lookups="thread", lookup_timeout_s=0.2)
    a.put([(block_key(1), payload(1))])
    release = hang_stats_under(monkeypatch, tmp_path)
    answers: list[list[bool]] = []

    def scheduler() -> None:
        answers.append(b.contains([block_key(1), block_key(2)]))  # waits 0.2 s
        answers.append(b.contains([block_key(1)]))  # the lookup still hangs: no wait

    try:
        thread = threading.Thread(target=scheduler, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "contains() waited for the hung stat"
        assert answers == [[False, False], [False]]
        assert b.stats()["lookup_timeouts"] == 2 and b.stats()["lookups"] == "thread"
    finally:
        release.set()
    deadline = time.monotonic() + 10  # the file system answers again: found once more
    while b.contains([block_key(1)]) != [True]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert b.stats()["discovered"] == 1


def test_lookups_from_two_threads_both_get_answers(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The scheduler and an I/O thread (checking before a write) ask at once,
    # while the file system is slow but answers within the timeout.
    a, b = make(tmp_path), make(tmp_path, lookups="thread", lookup_timeout_s=2.0)
    a.put([(block_key(i), payload(i)) for i in range(2)])
    real_stat = os.stat

    def slow_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(tmp_path)):
            time.sleep(0.1)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", slow_stat)
    answers: dict[int, list[bool]] = {}

    def ask(i: int) -> None:
        answers[i] = b.contains([block_key(i)])

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert answers == {0: [True], 1: [True]} and b.stats()["lookup_timeouts"] == 0


def test_checks_before_writes_do_not_queue_before_the_schedulers_lookups(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow (not hung) shared file system: an I/O thread checks a batch of new
    # blocks before writing them (2 s of stat calls) while the scheduler asks once.
    a, b = make(tmp_path), make(tmp_path, lookups="thread", lookup_timeout_s=0.5)
    a.put([(block_key(1), payload(1))])
    real_stat, checking = os.stat, threading.Event()

    def slow_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(tmp_path)):
            checking.set()
            time.sleep(0.05)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", slow_stat)
    batch = [block_key(i) for i in range(100, 140)]
    writer = threading.Thread(target=b.contains_waiting, args=(batch,), daemon=True)
    writer.start()
    assert checking.wait(5)
    assert b.contains([block_key(1)]) == [True]  # not refused behind the batch
    assert b.stats()["lookup_timeouts"] == 0
    writer.join(timeout=10)


def test_closing_the_tier_ends_its_lookup_thread(tmp_path: Path) -> None:
    def lookup_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "kvtier-disk-lookups"}

    # by identity: earlier tests' tiers, collected meanwhile, end theirs too
    before = lookup_threads()
    tier = make(tmp_path, lookups="thread")
    assert tier.contains([block_key(1)]) == [False]
    (thread,) = lookup_threads() - before
    tier.close()
    thread.join(10)
    assert not thread.is_alive(), "the lookup thread outlived its tier"


def test_lookups_go_to_a_thread_on_network_file_systems(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:41 / /mnt/kv rw shared:9 - nfs4 srv:/export rw,vers=4.2\n"
        "41 40 0:42 / /mnt/kv/local\\040disk rw - xfs /dev/sdb1 rw\n"
        "42 22 0:43 / /mnt/fuse rw - fuse.sshfs host:/ rw\n"
        "43 22 0:44 / /mnt/auto rw - autofs systemd-1 rw\n"  # NFS mounted on demand
        "44 43 0:45 / /mnt/auto rw - nfs4 srv:/auto rw\n")
    types = {path: file_system_type(path, str(mountinfo)) for path in
             ("/mnt/kv/cache", "/mnt/kvx", "/mnt/kv/local disk/x", "/mnt/fuse/a", "/",
              "/mnt/auto/kv")}
    assert types == {"/mnt/kv/cache": "nfs4", "/mnt/kvx": "ext4",
                     "/mnt/kv/local disk/x": "xfs", "/mnt/fuse/a": "fuse.sshfs", "/": "ext4",
                     "/mnt/auto/kv": "nfs4"}
    assert [may_hang(t) for t in types.values()] == [True, False, False, True, False, True]
    assert file_system_type("/", str(tmp_path / "missing")) is None
    here = make(tmp_path / "d")  # "auto": as the machine's own mount table says
    expected = "thread" if may_hang(file_system_type(here.root)) else "inline"
    assert here.stats()["lookups"] == expected
    assert make(tmp_path / "e", lookups="thread").stats()["lookups"] == "thread"
    with pytest.raises(TierConfigError, match="lookups must be one of"):
        make(tmp_path / "f", lookups="sometimes")
    for mode in ("inline", "thread"):
        with pytest.raises(TierConfigError, match="lookup_timeout_s"):
            make(tmp_path / "g", lookups=mode, lookup_timeout_s=float("nan"))


def test_rescan_bounds_the_union_of_engines(tmp_path: Path) -> None:
    cap = 6 * file_bytes()
    a = make(tmp_path, capacity=cap, rescan_interval_s=None)
    b = make(tmp_path, capacity=cap, rescan_interval_s=None)
    a.put([(block_key(i), payload(i)) for i in range(5)])
    b.put([(block_key(i), payload(i)) for i in range(10, 15)])
    assert len(block_files(tmp_path)) == 10
    b.rescan()
    assert len(block_files(tmp_path)) <= 6
    assert b.stats()["used_bytes"] <= cap


def test_threads_share_one_tier(tmp_path: Path) -> None:
    import threading

    tier = make(tmp_path, capacity=12 * file_bytes())
    bad: list[int] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        buf = np.zeros(SIZE, np.uint8)
        for _ in range(150):
            i = int(rng.integers(0, 24))
            if rng.random() < 0.5:
                tier.put([(block_key(i), payload(i))])
            elif tier.get_into([block_key(i)], [buf])[0] is not None and not np.array_equal(
                buf, payload(i)
            ):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = tier.stats()
    assert bad == [] and s["corrupt"] == 0 and s["errors"] == 0
    assert s["used_bytes"] <= s["capacity_bytes"] and s["pending_bytes"] == 0
    assert s["blocks"] == len(block_files(tmp_path)) and temp_files(tmp_path) == []
    # No other engine shares the directory: a block "gone" was a store of
    # another thread forgotten (the race above), which leaves a file outside the index
    assert [e for e in tier.take_events() if e.detail == "gone"] == []


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    cfg = {
        "path": str(tmp_path), "namespace": NS, "capacity": 16 * file_bytes(), "size": SIZE,
        "ids": list(range(40)), "seconds": 2.0, "rescan_interval_s": 0.3,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "disk-share", json.dumps({**cfg, "seed": seed})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )
        for seed in (1, 2)
    ]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        results.append(json.loads(stdout))
    for res in results:
        assert res["bad"] == 0
        assert res["hits"] > 0 and res["stores"] > 0
        assert res["stats"]["corrupt"] == 0 and res["stats"]["errors"] == 0
    assert sum(r["stats"]["discovered"] for r in results) > 0
    assert temp_files(tmp_path) == []
    on_disk = sum(f.stat().st_size for f in block_files(tmp_path))
    assert on_disk <= 2 * cfg["capacity"]  # type: ignore[operator]
    # Whatever is there is whole: a fresh engine reads every block back intact.
    fresh = make(tmp_path, capacity=cfg["capacity"])  # type: ignore[arg-type]
    for key in fresh.indexed_keys():
        i = int.from_bytes(key[:8], "big")
        assert bytes(fresh.get([key])[0]) == payload(i).tobytes()  # type: ignore[arg-type]
    assert fresh.stats()["corrupt"] == 0


def test_directory_removed_while_serving(tmp_path: Path) -> None:
    tier = make(tmp_path / "a" / "b" / "cache")  # missing parents are created
    tier.put([(block_key(1), payload(1))])
    shutil.rmtree(tmp_path / "a")
    assert tier.get([block_key(1)]) == [None]
    assert tier.put([(block_key(2), payload(2))]) == [True]  # directories made again
    assert tier.get([block_key(2)])[0] is not None
    assert tier.rescan() == 1


# ---------------------------------------------------------------- mistakes
def test_bad_config_is_explained(tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match="capacity_bytes"):
        DiskTier(tmp_path, NS, 0)
    with pytest.raises(TierConfigError, match="capacity_bytes"):
        DiskTier(tmp_path, NS, True)  # type: ignore[arg-type]
    with pytest.raises(TierConfigError, match="namespace"):
        DiskTier(tmp_path, "../escape", 1 << 20)
    with pytest.raises(TierConfigError, match="rescan_interval_s"):
        DiskTier(tmp_path, NS, 1 << 20, rescan_interval_s=0)
    with pytest.raises(TierConfigError, match="rescan_interval_s"):
        DiskTier(tmp_path, NS, 1 << 20, rescan_interval_s=float("nan"))  # it never rescanned
    with pytest.raises(TierConfigError, match="tmp_max_age_s"):
        DiskTier(tmp_path, NS, 1 << 20, tmp_max_age_s=float("inf"))
    with pytest.raises(TierConfigError, match="free_reserve_bytes"):
        DiskTier(tmp_path, NS, 1 << 20, free_reserve_bytes=-1)
    with pytest.raises(TierConfigError, match="holds no block"):  # every store was dropped
        DiskTier(tmp_path, NS, 128 << 10, max_block_bytes=256 << 10)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(TierConfigError, match="not a directory"):
        DiskTier(a_file, NS, 1 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a directory")
def test_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    make(tmp_path)
    os.chown(tmp_path / LAYOUT_DIR / NS, 12345, 12345)
    with pytest.raises(TierConfigError, match="uid 12345"):
        make(tmp_path)


def test_caller_mistakes_raise(tmp_path: Path) -> None:
    tier = make(tmp_path, max_block_bytes=SIZE)
    with pytest.raises(ValueError, match="max_block_bytes"):
        tier.put([(block_key(1), np.zeros(SIZE + 1, np.uint8))])
    with pytest.raises(ValueError, match="at most 120 bytes"):
        tier.put([(b"k" * 121, b"x")])
    with pytest.raises(TypeError):
        tier.contains(["abc"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="buffers"):
        tier.get_into([block_key(1)], [])
    with pytest.raises(ValueError, match="read-only"):
        tier.get_into([block_key(1)], [b"x" * SIZE])
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.get([block_key(1)])


def _held(events: list) -> dict[bytes, int]:
    """What a consumer counting stored / removed announcements believes."""
    refs: dict[bytes, int] = {}
    for event in events:
        for key in event.keys:
            refs[key] = refs.get(key, 0) + (1 if event.kind == "stored" else -1)
    return refs


def test_events_follow_blocks_other_engines_and_restarts_bring(tmp_path: Path) -> None:
    first = make(tmp_path, rescan_interval_s=None, lookups="inline")
    first.put([(block_key(i), payload(i)) for i in range(3)])
    first.close()
    a = make(tmp_path, rescan_interval_s=None, lookups="inline")  # a restart finds 3 blocks
    b = make(tmp_path, rescan_interval_s=None, lookups="inline")
    assert _held(a.take_events()) == {block_key(i): 1 for i in range(3)}
    b.put([(block_key(9), payload(9))])
    assert a.contains([block_key(9)]) == [True]  # another engine's block, found
    assert b.delete([block_key(0)]) == 1  # another engine's delete, seen at a rescan
    a.rescan()
    assert _held(a.take_events()) == {block_key(9): 1, block_key(0): -1}
