"""Serving-benchmark results made up for tests of the summary tables."""

from __future__ import annotations

from typing import Any

from kvtier.bench import serving


def run_result(config: str, repeat: int, **figures: Any) -> serving.RunResult:
    """One ``bench serve`` run of ``config``: plausible figures, ``figures`` replacing them."""
    base: dict[str, Any] = dict(
        config=config, traffic="bundled", regime="paced", cpu_blocks=1000, repeat=repeat,
        completed=10, failed=0, throughput=2.0, ttft_mean_ms=100.0, ttft_p50_ms=90.0,
        ttft_p99_ms=200.0, ttft_max_ms=250.0, hit_ratio=0.1, external_queries=100.0,
        external_hits=10.0)
    base.update(figures)
    return serving.RunResult(**base)
