"""The operator tools (``kvtier disk ...``) and the long-running tools
(soak, foresight, the serving benchmark's summary): faults found, each shown by
a test that failed on the code before its fix (see each test's comment)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_tools import NS_A, NS_B, block_path, cache, dead_pid, files_under, run

from kvtier import block_key
from kvtier.bench import serving
from kvtier.cli import main
from kvtier.file_locks import is_locked
from kvtier.replay.foresight import WindowLFU, use_times
from kvtier.replay.reference import prefix_hit_ratio
from kvtier.replay.soak import Sample, SoakConfig, run_soak
from kvtier.tiers import DiskTier
from kvtier.tiers.blockfile import CorruptBlockError
from kvtier.tiers.disk_dir import LAYOUT_DIR
from kvtier.tools import disk_admin

__all__ = ["cache"]  # the fixture, shared with tests/test_tools.py


def _returns_within(fn: Callable[[], Any], timeout_s: float,
                    unblock: Callable[[], None]) -> tuple[bool, Any]:
    """``(returned, result)`` of ``fn()`` run on a thread for at most ``timeout_s``;
    ``unblock()`` releases a thread still stuck, so that the test process ends."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the test
            result["value"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    returned = not thread.is_alive()
    if not returned:
        unblock()
        thread.join(5)
    return returned, result.get("value")


def _open_fifo_writer(path: Path) -> None:
    """Let a reader blocked in ``open(fifo, O_RDONLY)`` go on (and close at once)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def _fail_scandir(monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    """Make ``os.scandir(victim)`` fail with EIO (root reads through chmod 000)."""
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:
        if os.fspath(path) == victim:
            raise OSError(errno.EIO, "Input/output error", victim)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)


# ------------------------------------------------------------ unreadable directories
@pytest.mark.parametrize("action", ["inspect", "verify", "purge"])
def test_an_unreadable_fan_out_directory_is_an_error_not_a_traceback(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    action: str,
) -> None:
    # Fault: disk_layout's walk caught only FileNotFoundError from os.scandir, so
    # a fan-out directory that cannot be read (EIO on the damaged disk one runs
    # `verify` for; EACCES) escaped as a Python traceback. From the shell that is
    # exit status 1, which for `verify` means "bad blocks found", not "could not
    # check". Documented: a path that cannot be used is an error, exit status 2.
    # (The tests run as root, where chmod 000 does not stop a read: the failing
    # scandir is simulated for one directory.)
    victim = str(block_path(cache, NS_A, 0).parent)
    _fail_scandir(monkeypatch, victim)
    extra = ["--yes"] if action == "purge" else []
    code, out, err = run(capsys, "disk", action, str(cache), *extra)
    assert code == 2, (code, out, err)
    assert err.startswith("kvtier: error: ") and victim in err and "Input/output error" in err


# ------------------------------------------------------------ purge and live writers
def test_purge_leaves_the_temp_file_of_a_running_writer(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Fault: purge unlinked every temp file, also one a running engine holds
    # locked until its rename (README: temp files are held under a lock, and the
    # tools never remove a running writer's). The engine's rename then fails
    # (a dropped store logged as a write error). `verify --repair` already
    # leaves such a file; purge must as well, and say so.
    fan_out = block_path(cache, NS_A, 0).parent
    live = fan_out / f".{block_key(0).hex()}.{dead_pid()}.0.tmp"  # writer in another container
    live.write_bytes(b"partial")
    left = fan_out / f".{block_key(1).hex()}.{dead_pid()}.0.tmp"  # a dead writer's
    left.write_bytes(b"partial")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        code, out, _ = run(capsys, "disk", "purge", str(cache), "--namespace", NS_A, "--yes")
        assert code == 0
        assert live.exists(), "purge removed the temp file of a running writer"
    assert not left.exists()
    assert "removed 6 blocks" in out and "1 temp file " in out
    assert "1 temp file of a running writer" in out
    assert {p for p in files_under(cache) if NS_A in str(p)} == {live}


# ------------------------------------------------------------ FIFOs
def test_lock_probe_of_a_fifo_returns(tmp_path: Path) -> None:
    # Fault: is_locked opened the path with a blocking O_RDONLY: on a FIFO that
    # waits for a writer forever. The disk tier's start-up scan probes every
    # temp-named entry of a dead pid (without checking it is a regular file),
    # so one FIFO named like a temp file hung an engine's start. Same for the
    # slot regions' cleanup, which probes /dev/shm entries with it.
    fifo = tmp_path / f".{'ab' * 16}.{dead_pid()}.0.tmp"
    os.mkfifo(fifo)
    returned, value = _returns_within(lambda: is_locked(fifo), 3.0,
                                      lambda: _open_fifo_writer(fifo))
    assert returned, "is_locked hangs on a FIFO"
    assert value is False


def test_disk_tier_start_is_not_hung_by_a_fifo_named_like_a_temp_file(
    tmp_path: Path,
) -> None:
    # the engine-level consequence of the fault above
    path = tmp_path / "cache"
    DiskTier(path, NS_B, 1 << 20, free_reserve_bytes=0).close()
    fan_out = path / LAYOUT_DIR / NS_B / "00"
    fifo = fan_out / f".{'cd' * 16}.{dead_pid()}.0.tmp"
    os.mkfifo(fifo)
    returned, value = _returns_within(
        lambda: DiskTier(path, NS_B, 1 << 20, free_reserve_bytes=0), 10.0,
        lambda: _open_fifo_writer(fifo))
    assert returned, "DiskTier's start-up scan hangs on a FIFO named like a temp file"
    assert isinstance(value, DiskTier)
    value.close()
    assert fifo.exists()  # not a regular file: not kvtier's to remove


def test_reading_a_block_path_that_became_a_fifo_returns(tmp_path: Path) -> None:
    # Fault: read_block_file promises CorruptBlockError for anything that is not
    # a regular file, but opened before it looked: a FIFO (put at a block's path
    # between the walk's lstat and the read) blocked `verify` for good.
    fifo = tmp_path / "00ff.kvb"
    os.mkfifo(fifo)
    returned, value = _returns_within(lambda: disk_admin.read_block_file(str(fifo)), 3.0,
                                      lambda: _open_fifo_writer(fifo))
    assert returned, "read_block_file hangs on a FIFO"
    assert isinstance(value, CorruptBlockError) and value.reason == "not a regular file"


# ------------------------------------------------------------ redis inspect


def test_redis_keys_the_user_may_not_read_are_not_reported_as_foreign(
    redis_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Fault: every error reply to a page's STRLEN counted the key as an "other
    # key under kvtier: (not kvtier:<namespace>:<key> strings)", meant for
    # WRONGTYPE only. A user whose ACL covers one tenant's keys (SCAN is not
    # key-checked, STRLEN is: NOPERM), or a cluster replica (MOVED), got a
    # report with whole namespaces missing and their blocks called foreign,
    # exit status 0. Such an error must fail the command (exit status 2, the
    # error named), not be counted.
    import redis

    from kvtier.tiers.redis_tier import RedisTier

    raw = redis.Redis.from_url(redis_server.url)
    for ns in (NS_A, NS_B):
        tier = RedisTier(redis_server.url, ns, password_env=None)
        assert all(tier.put([(block_key(i), b"v" * 64) for i in range(20)]))
        tier.close()
    raw.set(b"kvtier:" + NS_A.encode() + b":a-hash", b"x")
    raw.hset(b"kvtier:" + NS_A.encode() + b":a-hash-too", b"f", b"v")  # WRONGTYPE: other
    raw.execute_command("ACL", "SETUSER", "tenant-a", "on", ">tenant-a-pw",
                        f"~kvtier:{NS_A}:*", "+@all")
    raw.close()

    host = redis_server.url.split("://", 1)[1]
    code, out, err = run(capsys, "redis", "inspect", redis_server.url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert {n["namespace"]: n["keys"] for n in report["namespaces"]} == {NS_A: 21, NS_B: 20}
    assert report["other_keys"] == 1

    code, out, err = run(capsys, "redis", "inspect", f"redis://tenant-a:tenant-a-pw@{host}",
                         "--json")
    assert code == 2, out
    assert err.startswith("kvtier: error: ") and "NoPermissionError" in err
    assert "tenant-a-pw" not in err


# ------------------------------------------------------------ purge stopped part way
def test_purge_stopped_by_an_unreadable_directory_says_what_it_removed(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fault: a directory purge could not read (EIO) stopped it with only the
    # error: the blocks it had already removed from the namespace before went
    # unreported, so the operator could not tell what was gone. Now it prints
    # what it removed, then the error (exit status 2).
    _, selected = disk_admin.select(cache)
    (first, _), (second, _) = selected  # purged in this order
    counts = {NS_A: 6, NS_B: 3}
    victim = str(block_path(cache, second, 0 if second == NS_A else 100).parent)
    _fail_scandir(monkeypatch, victim)
    code, out, err = run(capsys, "disk", "purge", str(cache), "--yes")
    monkeypatch.undo()
    assert code == 2, (code, out, err)
    assert "Input/output error" in err and "stopped part way" in err
    assert not [p for p in files_under(cache) if first in str(p)]
    found = re.search(r"before it stopped, removed (\d+) blocks", out)
    assert found and int(found.group(1)) >= counts[first], out


# ================================================================ long-running tools
# Faults found reviewing the soak, foresight and the serving benchmark's
# summary: each test names what a reported figure, message or output got wrong.
# Real parts (a real soak through the manager and a disk tier).


# ------------------------------------------------------------------ the soak


def test_the_soaks_own_samples_do_not_count_as_growth_after_warm_up(tmp_path: Path) -> None:
    """The soak's headline figure is the resident set's growth after warm-up.
    It kept every sample as two dicts of every structure's name (new key
    strings each time: about 6 KB a sample under tracemalloc, 10 KB in RSS),
    so its own history grew linearly and was reported as the library's
    growth: 20,000 requests sampled every 2 showed 73 MiB of growth against 16
    MiB sampled every 200. Here the Python memory traced after warm-up must
    stay flat while a sample is taken after every request, and every sample
    kept must be the one reported as it was taken."""
    config = SoakConfig(requests=1_200, cpu_blocks=64, disk_blocks=128, redis=False,
                        sample_every=1, kinds=("chat", "shared"), chunk=200,
                        max_tracker_size=512, eviction_history_size=256, max_events=256,
                        max_failed=64, workdir=str(tmp_path))
    traced: list[tuple[int, int]] = []
    seen: dict[int, Sample] = {}  # a few only: keeping all would grow this test's memory

    def on_sample(sample: Sample) -> None:
        traced.append((sample.requests, tracemalloc.get_traced_memory()[0]))
        if sample.requests % 300 == 0:
            seen[sample.requests] = sample

    tracemalloc.start()
    try:
        result = run_soak(config, on_sample=on_sample)
    finally:
        tracemalloc.stop()
    warm = next(memory for requests, memory in traced if requests >= config.requests // 4)
    growth = traced[-1][1] - warm
    # the old history: ~900 samples x ~6 KB after warm-up; the library's own
    # structures are full (and bounded) by then
    assert growth < 2 << 20, f"{growth / 2**20:.1f} MiB traced growth after warm-up"
    assert len(result.samples) == config.requests + 1 and len(seen) == 4
    assert all(result.samples[n] == sample for n, sample in seen.items())
    assert [s.requests for s in result.samples] == list(range(config.requests + 1))
    assert result.samples[-1].counters["verify_failures"] == 0
    assert result.summary()["violations"] == []


def _soak_cli(*flags: str) -> list[str]:
    return ["soak", "--cpu-blocks", "16", "--disk-blocks", "0", "--no-redis",
            "--no-progress", *flags]


def test_the_soak_names_the_flag_of_a_bad_sample_every(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Too many samples was reported as "raise sample_every to at least 200":
    the config field, not the ``--sample-every`` flag the user gave."""
    assert main(_soak_cli("--requests", "2000000", "--sample-every", "100")) == 2
    err = capsys.readouterr().err
    assert "--sample-every 100" in err and "--sample-every 200 or more" in err, err


def test_the_soak_takes_at_most_100_samples_by_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/guarantees.md: "A soak prints a header and one line per sample (100 in all)".
    The default interval was ``requests // 100`` rounded down: 150 requests
    took a sample after every request (150 lines), 1,000,050 took 101."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert main(_soak_cli("--requests", "150", "--json")) == 0
    lines = capsys.readouterr().out.splitlines()
    samples = [json.loads(line) for line in lines if '"rss_bytes"' in line]
    assert 1 < len(samples) <= 100, len(samples)
    assert samples[-1]["requests"] == 150


# ------------------------------------------------------------------ foresight


def test_foresight_stores_a_block_repeated_in_a_request_once() -> None:
    """``RankedCache.serve`` counted a hash id repeated in one request as two
    blocks to store: it evicted a resident block for the copy and left its
    slot empty (``LRUCache`` dedups). Capacity 2, the oracle ranking: request
    [3, 3] evicted both 1 and 2, so the later [3, 1] missed block 1."""
    requests = [[1, 2], [3, 3], [3], [3, 1]]
    cache = WindowLFU(2, 10, use_times(requests), future=True)
    # hits: [3] 1, [3, 1] 2, of 7 offered
    assert prefix_hit_ratio(requests, cache) == pytest.approx(3 / 7)
    assert len(cache.last) == 2


# ------------------------------------------------------------ purge interrupted
def test_an_interrupted_purge_says_what_it_removed(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fault: a Ctrl-C during `kvtier disk purge` exited 130 without a word: the
    # blocks removed until then are gone for good and the operator was not told
    # how many (a directory it cannot read is reported with the count, test
    # above). Ctrl-C is raised at the fourth file removed: a terminal cannot
    # deliver it there on demand.
    unlink = disk_admin._unlink
    calls = [0]

    def interrupted(path: str, summary: Any) -> bool:
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return unlink(path, summary)

    monkeypatch.setattr(disk_admin, "_unlink", interrupted)
    code, out, err = run(capsys, "disk", "purge", str(cache), "--yes")
    assert code == 130, (code, out, err)
    assert "before it was interrupted, removed 3 blocks" in out, out
    assert "purge interrupted" in err
    assert len([p for p in files_under(cache) if p.suffix == ".kvb"]) == 9 - 3


# ------------------------------------------------------------------ bench serve summary


def _run(config: str, cpu_blocks: int, repeat: int, throughput: float) -> serving.RunResult:
    return serving.RunResult(
        config=config, traffic="bundled", regime="paced", cpu_blocks=cpu_blocks,
        repeat=repeat, completed=10, failed=0, throughput=throughput, ttft_mean_ms=100.0,
        ttft_p50_ms=90.0, ttft_p99_ms=200.0, ttft_max_ms=250.0, hit_ratio=0.1,
        external_queries=100.0, external_hits=10.0)


def test_summarizing_one_cpu_size_keeps_the_no_offloading_baseline(tmp_path: Path) -> None:
    """No offloading runs once per repeat, recorded under the first CPU-tier
    size (``plan``). ``--summarize --cpu-blocks 4000`` (README: sizes may be
    chosen) looked for it under 4000 only: the ``none`` row vanished and every
    ``thr/none`` read "-", as if it had never run."""
    results = [_run("none", 1000, r, 4.0) for r in range(2)]
    results += [_run("lru", size, r, 2.0) for size in (1000, 4000) for r in range(2)]
    settings = serving.BenchSettings(
        model=tmp_path / "model", out=tmp_path / "out", configs=("none", "lru"),
        traffic=("bundled",), regimes=("paced",), cpu_blocks=(4000,), repeats=2)
    rows = {r.config: r for r in serving.summarize(results, settings)}
    assert set(rows) == {"none", "lru"}
    assert rows["none"].cpu_blocks == 4000 and rows["none"].repeats == 2
    assert rows["lru"].throughput_vs_none == pytest.approx(0.5)
