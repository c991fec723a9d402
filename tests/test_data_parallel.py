"""Data parallelism: ``kvtier serve ... --data-parallel-size 2`` runs two engines
(engine ids ``<id>_dp0``, ``<id>_dp1``), each with its own kvtier manager, CPU
slot region and disk tier on one shared directory; /metrics carries one series
per engine (label ``engine``), which ``kvtier.prom`` merges. Also two processes
owning a ``DiskTier`` on one directory, as two such engines do."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier import prom
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_dir import BLOCK_SUFFIX, allocated

# ---------------------------------------------------------------- prom: engines merged

DP_METRICS = """\
# HELP vllm:kvtier_usage_ratio Fraction of kvtier's CPU slots in use.
# TYPE vllm:kvtier_usage_ratio gauge
vllm:kvtier_usage_ratio{engine="0",model_name="m"} 0.75
vllm:kvtier_usage_ratio{engine="1",model_name="m"} 0.25
# HELP vllm:kvtier_resident Blocks held in kvtier's CPU tier.
# TYPE vllm:kvtier_resident gauge
vllm:kvtier_resident{engine="0",model_name="m"} 768.0
vllm:kvtier_resident{engine="1",model_name="m"} 256.0
# HELP vllm:kvtier_policy_admission 1 while admission is on.
# TYPE vllm:kvtier_policy_admission gauge
vllm:kvtier_policy_admission{engine="0",model_name="m"} 1.0
vllm:kvtier_policy_admission{engine="1",model_name="m"} 1.0
# HELP vllm:kvtier_policy_history_factor history.
# TYPE vllm:kvtier_policy_history_factor gauge
vllm:kvtier_policy_history_factor{engine="0",model_name="m"} 8.0
vllm:kvtier_policy_history_factor{engine="1",model_name="m"} 8.0
# HELP vllm:kvtier_tier_available 1 while the tier serves.
# TYPE vllm:kvtier_tier_available gauge
vllm:kvtier_tier_available{engine="0",model_name="m",tier="disk"} 1.0
vllm:kvtier_tier_available{engine="1",model_name="m",tier="disk"} 0.0
# HELP vllm:kv_offload_cpu_cache_usage_perc usage.
# TYPE vllm:kv_offload_cpu_cache_usage_perc gauge
vllm:kv_offload_cpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_offload_cpu_cache_usage_perc{engine="1",model_name="m"} 0.7
# HELP vllm:kvtier_hits Blocks found.
# TYPE vllm:kvtier_hits counter
vllm:kvtier_hits_total{engine="0",model_name="m"} 6.0
vllm:kvtier_hits_total{engine="1",model_name="m"} 4.0
vllm:kvtier_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:kvtier_hits_created{engine="1",model_name="m"} 1.8e+09
"""


def test_prom_merges_engines_ratios_and_switches_by_mean_amounts_by_sum() -> None:
    m = prom.parse(DP_METRICS)
    # a fraction stays a fraction of the whole (engines have equal slot counts),
    # a switch on in every engine reads 1, a setting reads as set
    assert prom.value(m, "vllm:kvtier_usage_ratio") == pytest.approx(0.5)
    assert prom.value(m, "vllm:kv_offload_cpu_cache_usage_perc") == pytest.approx(0.6)
    assert prom.value(m, "vllm:kvtier_policy_admission") == 1.0
    assert prom.value(m, "vllm:kvtier_policy_history_factor") == 8.0
    assert prom.value(m, "vllm:kvtier_tier_available", tier="disk") == 0.5
    # amounts and counters add up
    assert prom.value(m, "vllm:kvtier_resident") == 1024.0
    assert prom.value(m, "vllm:kvtier_hits_total") == 10.0
    assert prom.value(m, "vllm:kvtier_hits_created") == 1.7e9
    # one engine's figures, when the engine label is kept
    per_engine = prom.by_label(prom.parse(DP_METRICS, drop=("model_name",)),
                               "vllm:kvtier_usage_ratio", "engine")
    assert per_engine == {"0": 0.75, "1": 0.25}


API_SERVERS_METRICS = """\
# HELP vllm:kvtier_resident Blocks held in kvtier's CPU tier.
# TYPE vllm:kvtier_resident gauge
vllm:kvtier_resident{engine="1",model_name="m",pid="28809"} 18.0
vllm:kvtier_resident{engine="0",model_name="m",pid="28809"} 12.0
vllm:kvtier_resident{engine="1",model_name="m",pid="28808"} 18.0
vllm:kvtier_resident{engine="0",model_name="m",pid="28808"} 18.0
# HELP vllm:kvtier_usage_ratio Fraction of kvtier's CPU slots in use.
# TYPE vllm:kvtier_usage_ratio gauge
vllm:kvtier_usage_ratio{engine="1",model_name="m",pid="28809"} 0.5
vllm:kvtier_usage_ratio{engine="0",model_name="m",pid="28809"} 0.25
vllm:kvtier_usage_ratio{engine="1",model_name="m",pid="28808"} 0.5
vllm:kvtier_usage_ratio{engine="0",model_name="m",pid="28808"} 0.25
# HELP vllm:kvtier_hits Blocks found.
# TYPE vllm:kvtier_hits counter
vllm:kvtier_hits_total{engine="1",model_name="m"} 0.0
vllm:kvtier_hits_total{engine="0",model_name="m"} 6.0
"""
"""What /metrics of a DP=2 server with two API servers (vLLM's default) shows:
each API server's copy of each engine's gauge, labelled ``pid`` (here one copy
a step old); counters are summed by vLLM already."""


def test_prom_counts_an_engine_gauge_once_whatever_the_api_servers() -> None:
    m = prom.parse(API_SERVERS_METRICS)
    assert prom.value(m, "vllm:kvtier_resident") == 15.0 + 18.0  # not the copies' sum, 66
    assert prom.value(m, "vllm:kvtier_usage_ratio") == pytest.approx(0.375)
    assert prom.value(m, "vllm:kvtier_hits_total") == 6.0
    per_engine = prom.parse(API_SERVERS_METRICS, drop=("model_name",))
    assert prom.by_label(per_engine, "vllm:kvtier_resident", "engine") == {"0": 15.0, "1": 18.0}


def test_prom_of_one_engine_is_unchanged() -> None:
    one = "\n".join(line for line in DP_METRICS.splitlines() if 'engine="1"' not in line)
    m = prom.parse(one + "\n")
    assert prom.value(m, "vllm:kvtier_usage_ratio") == 0.75
    assert prom.value(m, "vllm:kvtier_resident") == 768.0


# ------------------------------------------------ kvtier serve: the engines' CPU tiers


def _printed_extra(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], str]:
    """``kvtier serve ... --print-command``: (kv_connector_extra_config, stderr)."""
    import json
    import shlex

    from kvtier.cli import main

    assert main(["serve", "/models/m", *args, "--print-command"]) == 0
    out = capsys.readouterr()
    argv = shlex.split(out.out)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return extra["kv_connector_extra_config"], out.err


@pytest.fixture
def small_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod limited to 4 GiB with 64 GiB of /dev/shm free (readings replaced)."""
    from kvtier import host_memory

    monkeypatch.setattr(host_memory, "physical_bytes", lambda: 512 << 30)
    monkeypatch.setattr(host_memory, "cgroup_limit_bytes", lambda: 4 << 30)
    monkeypatch.setattr(host_memory, "free_bytes", lambda _: 64 << 30)


def test_the_default_cpu_tier_is_shared_by_the_data_parallel_engines(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        small_host: None) -> None:
    from kvtier import host_memory

    # each engine makes a CPU tier of cpu_bytes_to_use: two engines, half each
    assert _printed_extra(capsys)[0]["cpu_bytes_to_use"] == 1 << 30
    for dp in (["--data-parallel-size", "2"], ["-dp=2"],
               ["--data-parallel-size", "4", "--data-parallel-size-local", "2"]):
        assert _printed_extra(capsys, *dp)[0]["cpu_bytes_to_use"] == 512 << 20, dp
    # one rank per server (external load balancing): the whole default
    assert _printed_extra(capsys, "--data-parallel-size", "2", "--data-parallel-rank",
                          "1")[0]["cpu_bytes_to_use"] == 1 << 30
    # half of a small /dev/shm, shared by the engines
    monkeypatch.setattr(host_memory, "free_bytes", lambda _: 64 << 20)
    extra, err = _printed_extra(capsys, "--data-parallel-size", "2")
    assert extra["cpu_bytes_to_use"] == 16 << 20 and "each of 2 engines" in err


def test_cpu_bytes_that_fit_once_but_not_per_engine_are_refused_before_start(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        small_host: None) -> None:
    from kvtier import host_memory
    from kvtier.cli import main

    monkeypatch.setattr(host_memory, "free_bytes", lambda _: 64 << 20)
    assert _printed_extra(capsys, "--cpu-bytes", "40Mi")[0]["cpu_bytes_to_use"] == 40 << 20
    status = main(["serve", "/models/m", "--cpu-bytes", "40Mi", "--data-parallel-size", "2",
                   "--print-command"])  # checked first; never starts a server
    assert status == 2
    err = capsys.readouterr().err
    assert "each of 2 data-parallel engines" in err and "--shm-size" in err


# ---------------------------------------------------------------- two processes, one disk dir

NS = "dp" + "0" * 30
PAYLOAD = 8000
ACCT = allocated(PAYLOAD + 200)  # header included: one 4 KiB unit more than the payload
KEYS = 120
CAP_BLOCKS = 30


def _key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() + b"\0\0\0\0"


def _payload(key: bytes, writer: int) -> bytes:
    """The block of ``key``: the same bytes whoever writes it, and a last byte
    naming the writer (either writer's copy is a right answer)."""
    head = hashlib.blake2b(key, digest_size=64).digest()
    return (head * (PAYLOAD // 64 + 1))[:PAYLOAD - 1] + bytes([writer])


def _block_files(root: Path) -> dict[bytes, int]:
    out = {}
    for f in root.rglob("*" + BLOCK_SUFFIX):
        with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
            out[bytes.fromhex(f.name[:-len(BLOCK_SUFFIX)])] = allocated(f.stat().st_size)
    return out


def _engine_like(path: str, writer: int, seconds: float, out: Any) -> None:
    """Store, read and look up overlapping keys as a DP engine's disk tier does;
    report bad reads, what the index holds and, after a rescan, whether it
    matches the directory."""
    import random

    tier = DiskTier(path, NS, CAP_BLOCKS * ACCT, free_reserve_bytes=0,
                    rescan_interval_s=1.0, lookups="inline")
    rng = random.Random(writer)
    bad = hits = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key = _key(rng.randrange(KEYS))
        op = rng.random()
        if op < 0.5:
            tier.put([(key, _payload(key, writer))])
        elif op < 0.9:
            got = tier.get([key])[0]
            if got is not None:
                hits += 1
                data = bytes(got)
                bad += data[:-1] != _payload(key, 0)[:-1] or data[-1] not in (0, 1)
        else:
            tier.contains([key])
    out.put(("stopped", writer, sorted(tier.indexed_keys()), tier.stats()["used_bytes"]))
    time.sleep(1.0)  # the other process stops writing too
    tier.rescan()
    out.put(("rescanned", writer, bad, hits, sorted(tier.indexed_keys()),
             tier.stats()["used_bytes"]))


def test_two_engines_on_one_disk_directory_stay_bounded_and_converge(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_engine_like, args=(str(tmp_path), w, 3.0, out))
             for w in (0, 1)]
    for p in procs:
        p.start()
    capacity = CAP_BLOCKS * ACCT
    most = 0
    messages: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + 120
    while len(messages) < 4 and time.monotonic() < deadline:
        most = max(most, sum(_block_files(tmp_path).values()))
        while not out.empty():
            messages.append(out.get())
        time.sleep(0.01)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    stopped = {m[1]: m for m in messages if m[0] == "stopped"}
    rescanned = {m[1]: m for m in messages if m[0] == "rescanned"}
    assert set(stopped) == set(rescanned) == {0, 1}
    # never a wrong byte, and the engines did share blocks
    assert all(r[2] == 0 for r in rescanned.values())
    assert sum(r[3] for r in rescanned.values()) > 0
    # each engine's index within capacity; the directory within the engines'
    # capacities together (each bounds what it knows of), plus a write in flight each
    assert all(s[3] <= capacity for s in stopped.values())
    assert most <= 2 * capacity + 2 * ACCT
    # no orphan: every file on disk is in some engine's index (so some engine
    # will evict it), checked once both stopped
    files = _block_files(tmp_path)
    assert set(files) <= set(stopped[0][2]) | set(stopped[1][2])
    # after a rescan each index is the directory (phantoms of blocks the other
    # removed are gone, its blocks adopted), within capacity
    files = _block_files(tmp_path)
    assert sum(files.values()) <= capacity
    for r in rescanned.values():
        assert set(r[4]) == set(files) and r[5] == sum(files.values())


# ---------------------------------------------------------------- real DP engines

ENGINE = ["--block-size", "32", "--max-model-len", "512", "--num-gpu-blocks-override", "24",
          "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.5",
          "--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "4"]
"""As tests/test_serve_e2e.py: a 24-block engine cache, four 200-token fillers
push a prompt out of it."""
OFFLOADED_TOKENS = 192  # the target's 6 full blocks of 32


def _complete(url: str, model: Path, prompt: list[int], rank: int) -> str:
    """Greedy completion on DP engine ``rank`` (vLLM's ``X-data-parallel-rank``)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model=str(model), prompt=prompt, max_tokens=16, temperature=0.0,
        extra_headers={"X-data-parallel-rank": str(rank)})
    return out.choices[0].text


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)")
def test_a_dp2_server_gives_each_engine_its_region_and_shares_the_disk(tmp_path: Path) -> None:
    from kvtier.bench.drill_engine import session_regions
    from kvtier.demo.tiny_model import build_tiny_llama, token_prompt
    from kvtier.server_process import ServerProcess, session_pids
    from kvtier.tiers.redis_server import free_port

    model = build_tiny_llama(tmp_path / "tiny-llama")
    target = token_prompt(200, start=5)
    fillers = [token_prompt(200, start=100 + 37 * i) for i in range(4)]
    port = free_port()
    argv = [sys.executable, "-m", "kvtier", "serve", str(model), "--cpu-bytes", "32Mi",
            "--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64Mi",
            "--port", str(port), *ENGINE, "--data-parallel-size", "2"]  # 2 API servers
    server = ServerProcess(argv, port, tmp_path / "dp.log").start()
    try:
        assert server.proc is not None
        regions = session_regions(session_pids(server.proc.pid))
        # engine 0: cold target (nothing cached anywhere: the answer of an engine
        # without kvtier), pushed out of its GPU cache, then from kvtier's CPU tier
        first = [_complete(server.url, model, p, 0) for p in [target, *fillers, target]]
        # engine 1 never saw the target: engine 0's blocks come from the shared disk
        second = _complete(server.url, model, target, 1)
        deadline = time.monotonic() + 15
        while True:  # vLLM reports stats a step late
            m = prom.parse(_metrics_text(server.url), drop=("model_name",))
            disk = prom.value(m, "vllm:prompt_tokens_cached_by_source_total",
                              source="disk", engine="1")
            if disk >= OFFLOADED_TOKENS or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        merged = prom.scrape(server.url)
        raw = _metrics_text(server.url)
    finally:
        server.stop()
    names = sorted(r.name for r in regions)
    assert len(names) == 2 and "_dp0-" in names[0] and "_dp1-" in names[1], names
    assert first[-1] == first[0] and second == first[0]
    assert prom.value(m, "vllm:prompt_tokens_cached_by_source_total",
                      source="host", engine="0") == OFFLOADED_TOKENS
    assert disk == OFFLOADED_TOKENS
    for engine in ("0", "1"):  # both engines got kvtier hits
        assert prom.value(m, "vllm:external_prefix_cache_hits_total",
                          engine=engine) == OFFLOADED_TOKENS
    # merged across engines: hits add up, the usage fraction stays one
    assert prom.value(merged, "vllm:external_prefix_cache_hits_total") == 2 * OFFLOADED_TOKENS
    usage = prom.by_label(m, "vllm:kvtier_usage_ratio", "engine")
    assert prom.value(merged, "vllm:kvtier_usage_ratio") == pytest.approx(
        sum(usage.values()) / 2)
    # each API server shows its copy of an engine's gauges (label pid); merged,
    # an engine counts once: no more blocks resident than stored or promoted
    # (none evicted; each copy is as of a step, these counters are the totals)
    assert 'vllm:kvtier_resident{engine="0"' in raw and "pid=" in raw
    came = (prom.value(merged, "vllm:kvtier_stores_total")
            + prom.value(merged, "vllm:kvtier_promotions_total"))
    assert prom.value(merged, "vllm:kvtier_evictions_total") == 0
    assert 0 < prom.value(merged, "vllm:kvtier_resident") <= came


def _metrics_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return str(r.read().decode())
