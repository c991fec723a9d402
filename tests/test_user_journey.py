"""The README walked as a production engineer adopting kvtier: what a user
following it ran into, each pinned here (real vLLM metric classes, a real
disk tier, the real ``kvtier`` command line)."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).parent.parent
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm(-cpu)")
SLOTS = 16
SIZE = 4096
SPEC = {"spec_name": "KVTierSpec", "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 1}


def _prometheus(extra_config: dict[str, Any]) -> tuple[Any, Any]:
    """vLLM's own offloading Prometheus metrics (``OffloadPromMetrics``) for
    KVTierSpec, on a registry of their own: (metrics, registry)."""
    import prometheus_client as prom
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    registry = prom.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (prom.Counter, prom.Gauge, prom.Histogram)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config=extra_config))
    metrics = OffloadPromMetrics(config, types, ["engine"], {0: ["0"]})  # type: ignore[arg-type]
    return metrics, registry


def _series(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample /metrics would show: (name, labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


@needs_vllm
def test_every_counter_is_exported_at_zero_before_its_first_event(tmp_path: Path) -> None:
    """README, Metrics: an operator alerts on ``vllm:kvtier_tier_errors`` or
    ``_write_failures``. vLLM creates a labelled series only when it is first
    increased, and kvtier sent a counter only once it had grown: /metrics
    held no ``vllm:kvtier_tier_errors_total{tier="disk"}`` (nor ``_evictions``,
    ``_hits``...) until the first error, and a series that first appears at
    5 errors gives ``increase()`` and ``rate()`` nothing, so an alert missed
    the first outage and dashboards showed "no data" instead of 0. Every
    counter now has its series, at 0, from the engine's first step."""
    from kvtier import OffloadManager
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers import KVLayout
    from kvtier.tiers.cascade import TierCascade
    from kvtier.tiers.disk import DiskTier
    from kvtier.vllm import metrics as M
    from kvtier.vllm.adapter import KVTierOffloadingManager

    prom, registry = _prometheus(dict(SPEC))
    ns = KVLayout("m", "bfloat16", 16, 2, 2, 64).namespace()
    disk = DiskTier(tmp_path / "disk", ns, 64 << 20, free_reserve_bytes=0)
    with SlotRegion.create("journey-metrics", SLOTS, SIZE, shm_dir=tmp_path) as region:
        cascade = TierCascade(OffloadManager(SLOTS), region, [disk])
        adapter = KVTierOffloadingManager(cascade.manager, cascade)
        try:
            prom.observe(adapter.get_stats().data)  # an idle engine's first step
            prom.observe(adapter.get_stats().data)  # and its next: nothing counted twice
        finally:
            adapter.shutdown()
    series = _series(registry)
    engine = (("engine", "0"),)
    for name in (*M.COUNTERS, *M.TIER_COUNTERS):
        assert series.get((f"{M.METRIC_PREFIX}{name}_total", engine)) == 0, name
    disk_counts = [n for n in M.PER_TIER_COUNTERS if isinstance(disk.stats().get(n), int)]
    assert {"errors", "dropped_stores", "hits", "corrupt"} <= set(disk_counts)
    for name in disk_counts:  # the disk tier's own (corrupt_kept is Redis')
        labels = (("engine", "0"), ("tier", "disk"))
        assert series.get((f"{M.METRIC_PREFIX}tier_{name}_total", labels)) == 0, name


@needs_vllm
def test_counters_still_report_their_increase_after_the_first_step() -> None:
    """The zero sent first is a start, nothing more: later steps send what
    was added since, and a step that added nothing sends nothing."""
    from kvtier import OffloadManager
    from kvtier.vllm.metrics import METRIC_PREFIX, fill_stats

    manager = OffloadManager(SLOTS, policy="lru")
    reported: dict[str, int] = {}

    def step(**counts: int) -> dict[str, Any]:
        out = fill_stats({**manager.stats(), **counts}, SLOTS, reported)
        return {k: v.get(()) for k, v in out.data["data"].items()}

    hits = METRIC_PREFIX + "hits"
    assert step()[hits] == 0
    assert hits not in step()
    assert step(hits=3)[hits] == 3
    assert step(hits=5)[hits] == 2


def test_the_pinned_gauge_counts_the_writes_to_lower_tiers(tmp_path: Path) -> None:
    """``vllm:kvtier_pinned``'s help said "being read by a load": with a disk
    tier, an engine that loaded nothing showed tens of pinned blocks while
    they were written to disk (seen on a real ``kvtier serve``), which an
    operator reads as loads stuck in flight. The help names both readers."""
    from kvtier import OffloadManager, RequestContext, block_key
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers import KVLayout
    from kvtier.tiers.cascade import TierCascade
    from kvtier.tiers.disk import DiskTier
    from kvtier.vllm.metrics import GAUGES

    ns = KVLayout("m", "bfloat16", 16, 2, 2, 64).namespace()
    disk = DiskTier(tmp_path / "disk", ns, 64 << 20, free_reserve_bytes=0)
    with SlotRegion.create("journey-pinned", SLOTS, SIZE, shm_dir=tmp_path) as region:
        cascade = TierCascade(OffloadManager(SLOTS), region, [disk])
        try:
            keys = [block_key(bytes([i]) * 32) for i in range(4)]
            ctx = RequestContext("writer")
            out = cascade.prepare_store(keys, ctx)
            assert out is not None
            cascade.complete_store(keys, ctx, success=True)
            cascade.on_request_finished(ctx)
            cascade.on_schedule_end()  # the writes to disk start
            deadline = time.monotonic() + 10
            while disk.stats()["stores"] < len(keys) and time.monotonic() < deadline:
                time.sleep(0.01)
            # written, but not yet applied by a step: their slots are still read-pinned
            assert cascade.manager.stats()["pinned"] == len(keys)
            assert cascade.manager.stats()["leased"] == 0  # and no request loads them
        finally:
            cascade.shutdown()
    help_text = GAUGES["pinned"].lower()
    assert "load" in help_text and ("disk" in help_text or "tier" in help_text)


def _print_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", "serve", "/models/m",
                           "--cpu-bytes", "1GiB", *args, "--print-command"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None
                    or importlib.util.find_spec("kvtier.launch") is None,
                    reason="needs vllm(-cpu)")
def test_print_command_says_how_to_run_its_line_on_the_cpu_build() -> None:
    """README: ``--print-command`` shows "the equivalent ``vllm serve``
    line", and the same section says vLLM's CPU build's own ``vllm`` script
    cannot start. A user who copied the printed line on the CPU build got a
    ``PackageNotFoundError`` traceback and no hint. On that build the
    printed line now comes with how to run it: ``python -m kvtier.launch``."""
    from kvtier.launch import CPU_DISTRIBUTION, installed_vllm

    if installed_vllm() != CPU_DISTRIBUTION:
        pytest.skip("vLLM's CUDA build: its vllm script runs the line as printed")
    done = _print_command("--port", "8000")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("vllm serve /models/m --port 8000 --kv-transfer-config ")
    assert "python -m kvtier.launch" in done.stderr
