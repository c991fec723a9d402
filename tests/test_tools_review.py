"""Review of the operator tools (``kvtier disk ...``): faults found, each shown by
a test that failed on the code before its fix (see each test's comment)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_tools import NS_A, NS_B, block_path, cache, dead_pid, files_under, run

from kvtier import block_key
from kvtier.file_locks import is_locked
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
@pytest.fixture
def redis_server() -> Iterator[Any]:
    pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
    from kvtier.tiers.redis_server import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server binary (see tests/test_tier_redis.py)")
    srv = RedisServer().start()
    yield srv
    srv.close()


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
