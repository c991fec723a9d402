"""A tier fault while a real server is under load (``kvtier bench faults``, short):
every request completes, the probe prompt's answer is unchanged, and the fault
shows in the server's metrics. Latency bounds are measured by the benchmark
(``python benchmarks/bench_faults.py``), never asserted here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtier.bench import faults
from kvtier.demo.tiny_model import build_tiny_llama
from kvtier.tiers.redis_server import find_server_binary

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
    pytest.mark.skipif(find_server_binary() is None, reason="needs redis-server"),
]


def test_redis_stopped_under_load_costs_hits_not_requests(tmp_path: Path) -> None:
    s = faults.FaultSettings(model=build_tiny_llama(tmp_path / "model"), out=tmp_path / "out",
                             faults=("none", "redis-stop"), requests=150, speedup=4.0,
                             fault_at_s=2.0, fault_for_s=4.0)
    clean, stopped = faults.run_all(s, say=lambda _: None)
    for r in (clean, stopped):
        assert (r.completed, r.failed) == (150, 0), r
        assert r.probe_same, r
    assert clean.tier_errors.get("redis", 0) == 0 and clean.counters["write_failures"] == 0
    shown = stopped.tier_errors.get("redis", 0) + stopped.counters["write_failures"]
    assert shown > 0, stopped  # the outage is in the metrics
    assert clean.kvtier_tokens > 0
    lines = faults.table([clean, stopped])
    assert lines[1].startswith("none") and lines[2].startswith("redis-stop")
