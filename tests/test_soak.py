"""Bounded memory (issue 10): a short soak through the manager, disk and Redis,
and the bounds added for it (lease holders, finished I/O jobs)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.leases import LeaseTable
from kvtier.manager import OffloadManager
from kvtier.replay.mix import TrafficMix
from kvtier.replay.soak import Sample, SoakConfig, bounds, flatten, run_soak, violations
from kvtier.replay.tiered import NAMESPACE
from kvtier.request import RequestContext
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_dir import ALLOC_UNIT
from kvtier.tiers.io_pool import IOPool, ProbeJob
from kvtier.tiers.redis_server import find_server_binary

NO_SERVER = "no redis-server or valkey-server binary (`make venv` installs one)"

SHORT = SoakConfig(
    requests=3_000, cpu_blocks=256, disk_blocks=1_024, redis_maxmemory=4 << 20,
    kinds=("chat", "shared", "rag"), chunk=500, sample_every=150,
    max_tracker_size=2_048, eviction_history_size=512, max_events=1_024,
    max_probes=2_048, max_failed=256, store_threshold=1, tier_store_threshold=2,
)
"""Small caches and bounds, so that every structure fills within the run."""
RSS_GROWTH_LIMIT = 12 << 20
"""RSS the short soak may still gain after its first quarter (all full by then)."""


Soak = tuple[list[Sample], dict[str, int], dict[str, Any]]


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory: pytest.TempPathFactory) -> Soak:
    if find_server_binary() is None:
        pytest.skip(NO_SERVER)
    config = dataclasses.replace(SHORT, workdir=str(tmp_path_factory.mktemp("soak")))
    result = run_soak(config)
    return result.samples, result.bounds, result.summary()


# -- the short soak ----------------------------------------------------------------


def test_short_soak_keeps_every_structure_within_its_bound(short_soak: Soak) -> None:
    samples, limits, summary = short_soak
    assert summary["violations"] == []
    assert samples[-1].requests == SHORT.requests
    assert samples[-1].counters["verify_failures"] == 0
    # every bounded structure the soak names was sampled, with both tiers in it
    for name in ("manager.table", "manager.history_size", "manager.events", "cascade.uses",
                 "cascade.tiers.disk.index", "cascade.probes.redis.known",
                 "manager.policy.history", "cascade.queued_writes", "cascade.done"):
        assert name in limits and name in samples[-1].sizes


def test_short_soak_fills_the_caches_and_uses_both_tiers(short_soak: Soak) -> None:
    samples, _, summary = short_soak
    peak = summary["peak_fill"]
    for name in ("manager.table", "manager.history_size", "manager.events",
                 "cascade.tiers.disk.index", "cascade.uses", "cascade.probes.redis.known"):
        assert peak[name] >= 0.9, name  # filled to (nearly) its bound: the bound was tested
    counters = samples[-1].counters
    assert counters["disk.stores"] > 0 and counters["redis.stores"] > 0
    assert counters["tier_hit_blocks"] > 0 and counters["evictions"] > 0
    assert counters["events_dropped"] > 0  # nobody takes the events: the log is full


def test_short_soak_memory_flattens_after_warm_up(short_soak: Soak) -> None:
    samples, _, summary = short_soak
    warm = next(s for s in samples if s.requests >= SHORT.requests // 4)
    growth = samples[-1].rss_bytes - warm.rss_bytes
    assert growth < RSS_GROWTH_LIMIT, (summary["rss_mib_start"], summary["rss_mib_end"])


def test_violations_name_a_structure_over_its_bound() -> None:
    limits = bounds(SHORT, longest_request=40)
    sample = Sample(10, 1.0, 0, {"manager.table": SHORT.cpu_blocks + 1,
                                 "cascade.uses": SHORT.max_tracker_size}, {})
    found = violations([sample], limits)
    assert found == [f"manager.table={SHORT.cpu_blocks + 1} > {SHORT.cpu_blocks} at 10 requests"]


def test_flatten_names_nested_sizes() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3, "f": "x", "g": True}) == {
        "a.b": 1, "a.c.d": 2, "e": 3}


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="sample_every"):
        SoakConfig(requests=1_000_000, sample_every=1).check()
    with pytest.raises(ValueError, match="cpu_blocks"):
        SoakConfig(cpu_blocks=0).check()
    with pytest.raises(ValueError, match="unknown workload"):
        SoakConfig(kinds=("nope",)).check()


# -- the traffic mix -----------------------------------------------------------------


def test_mix_is_seeded_keyed_like_vllm_and_holds_one_chunk_per_kind() -> None:
    a, b = TrafficMix(("chat", "rag"), seed=3, chunk=50), TrafficMix(("chat", "rag"), seed=3,
                                                                    chunk=50)
    first = [a.next_keys() for _ in range(400)]
    assert first == [b.next_keys() for _ in range(400)]
    assert {kind for kind, _ in first} == {"chat", "rag"}
    assert all(len(key) == 36 for _, keys in first for key in keys)
    assert a.sizes() == {"chunks": 2, "served": 400}
    other = TrafficMix(("chat", "rag"), seed=4, chunk=50)
    assert [other.next_keys() for _ in range(50)] != first[:50]


def test_mix_reuses_keys_within_a_chunk_only() -> None:
    mix = TrafficMix(("chat",), chunk=100)
    chunks = [{k for _ in range(100) for k in mix.next_keys()[1]} for _ in range(2)]
    assert not chunks[0] & chunks[1]  # chunks share no content


# -- bounds added for the soak ----------------------------------------------------------


def test_lease_holders_are_capped_oldest_first() -> None:
    mgr = OffloadManager(16, max_lease_holders=3)
    ks = [kvtier.block_key(i) for i in range(4)]
    ctx = RequestContext("writer")
    out = mgr.prepare_store(ks, ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    holders = [RequestContext(f"r{i}") for i in range(6)]
    for i, holder in enumerate(holders):  # each leases a key and never finishes
        assert mgr.lookup([ks[i % 4]], holder) == 1
        assert mgr.debug_state()["lease_holders"] <= 3 + 1
    mgr.lookup([ks[0]], RequestContext("last"))
    assert mgr.debug_state()["lease_holders"] <= 3 + 1
    assert not holders[0].leased and not holders[1].leased  # the oldest lapsed first
    assert holders[-1].leased


def test_lease_table_rejects_a_bad_holder_cap() -> None:
    with pytest.raises(ValueError, match="max_lease_holders"):
        LeaseTable(4, 4, 1.0, max_holders=0)


def test_finished_jobs_nobody_takes_are_bounded(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", NAMESPACE, 16 * ALLOC_UNIT, free_reserve_bytes=0,
                    rescan_interval_s=None)
    pool = IOPool(1, max_queue=2)
    try:
        accepted = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if pool.submit(ProbeJob(tier, [kvtier.block_key(accepted)])):
                accepted += 1
            elif pool.sizes()["done"] >= pool.max_done:
                break
            else:
                time.sleep(0.001)
        assert pool.max_done == 2 * 2 + 1
        while pool.queued() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.001)  # what was accepted before may still finish
        time.sleep(0.05)
        assert pool.max_done <= pool.sizes()["done"] <= 2 * pool.max_done
        assert not pool.submit(ProbeJob(tier, [b"k"]))  # refused while nobody takes them
        assert len(pool.take_done()) >= pool.max_done
        assert pool.submit(ProbeJob(tier, [b"k"]))
    finally:
        pool.shutdown(5)


# -- the command -----------------------------------------------------------------------


def test_kvtier_soak_command_prints_samples_and_summary(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    from kvtier.cli import main

    plot = tmp_path / "soak.png"
    code = main(["soak", "--requests", "200", "--cpu-blocks", "64", "--disk-blocks", "128",
                 "--no-redis", "--kinds", "chat", "--sample-every", "50", "--json",
                 "--no-progress", "--plot", str(plot)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    samples = [json.loads(line) for line in out if line.startswith('{"requests"')]
    assert [s["requests"] for s in samples] == [50, 100, 150, 200]
    summary = json.loads(next(line for line in out if line.startswith('{"summary"')))
    assert summary["summary"]["violations"] == [] and summary["bounds"]["manager.table"] == 64
    assert plot.stat().st_size > 10_000


def test_kvtier_soak_command_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    assert main(["soak", "--requests", "10", "--kinds", "nope", "--no-progress"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    # a Redis size with no Redis tier was ignored
    assert main(["soak", "--requests", "10", "--no-redis", "--redis-maxmemory", "1000",
                 "--no-progress"]) == 2
    assert "--redis-maxmemory" in capsys.readouterr().err


def test_sigterm_removes_the_soak_directory(tmp_path: Path) -> None:
    # SIGINT always cleaned up; SIGTERM left /tmp/kvtier-soak-* and its disk tier
    from test_cli import sigterm_leaves_no_temp_dir

    sigterm_leaves_no_temp_dir(["soak", "--requests", "1000000", "--cpu-blocks", "64",
                                "--disk-blocks", "128", "--no-redis", "--kinds", "chat",
                                "--no-progress", "--json"], "kvtier-soak-", tmp_path)
