"""Replays under several key seeds, summarized: ``kvtier replay --key-seed 0-7``.

The default policy's shadow caches sample blocks by their hash, so one replay
is one draw of that sample (``kvtier.replay.rekey``), as one deployment's
block hashes are. A figure worth acting on is the median over several draws,
each policy compared with a baseline (the first policy named) in the same
draw: :func:`summarize` turns the per-seed results into one
:class:`SeedSummary` per policy, capacity and store threshold.

The bounds (OPT, infinite) do not depend on the key seed: Belady's choice
reads next-use times only, ties broken by time, never by key bytes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvtier.replay.driver import ReplayResult


def seeds_label(seeds: Sequence[int]) -> str:
    """``seeds`` written short: runs of consecutive seeds as ``A-B``."""
    parts: list[str] = []
    ordered = sorted(seeds)
    start = prev = ordered[0]
    for seed in [*ordered[1:], None]:
        if seed is not None and seed == prev + 1:
            prev = seed
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if seed is not None:
            start = prev = seed
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class SeedSummary:
    """One policy, capacity and store threshold over key seeds ``key_seeds``.

    ``hit_ratio`` is the median of the seeds' hit ratios (behind an engine
    cache: the CPU tier's), ``hit_ratio_min`` / ``_max`` their range;
    ``vs_baseline`` is the median of the per-seed ratios to ``baseline``'s hit
    ratio at the same capacity and threshold under the same seed, ``vs_min`` /
    ``vs_max`` their range. Seeds where the baseline hit nothing have no
    ratio; None when no seed has one.
    """

    policy: str
    capacity: int
    store_threshold: int
    key_seeds: tuple[int, ...]
    hit_ratio: float
    hit_ratio_min: float
    hit_ratio_max: float
    baseline: str
    vs_baseline: float | None
    vs_min: float | None
    vs_max: float | None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict, in declaration order."""
        out = asdict(self)
        out["key_seeds"] = list(self.key_seeds)
        return out


Cell = tuple[str, int, int]
"""A replay's policy, capacity and store threshold."""


def _cell(r: ReplayResult) -> Cell:
    return r.policy, r.capacity, r.store_threshold


def summarize(results: Sequence[tuple[int, ReplayResult]], baseline: str) -> list[SeedSummary]:
    """One summary per cell of ``results`` (``(key seed, result)`` pairs), in the
    order cells first appear; ``ValueError`` when ``baseline`` is missing from a
    seed and capacity that another policy has."""
    by_cell: dict[Cell, dict[int, float]] = {}
    for seed, r in results:
        by_cell.setdefault(_cell(r), {})[seed] = r.hit_ratio
    out = []
    for (policy, capacity, threshold), ratios in by_cell.items():
        base = by_cell.get((baseline, capacity, threshold))
        if base is None or not base.keys() >= ratios.keys():
            raise ValueError(f"no {baseline} replay at capacity {capacity}, threshold "
                             f"{threshold} under every key seed to compare {policy} with")
        values = list(ratios.values())
        vs = [ratios[s] / base[s] for s in ratios if base[s] > 0]
        out.append(SeedSummary(
            policy, capacity, threshold, tuple(ratios), statistics.median(values),
            min(values), max(values), baseline,
            statistics.median(vs) if vs else None, min(vs, default=None),
            max(vs, default=None)))
    return out


def median_results(results: Sequence[tuple[int, ReplayResult]],
                   summaries: Sequence[SeedSummary]) -> list[ReplayResult]:
    """One result per summary, its hit ratio the median (the other figures are
    the first seed's): what a plot of the medians draws."""
    first: dict[Cell, ReplayResult] = {}
    for _, r in results:
        first.setdefault(_cell(r), r)
    return [replace(first[s.policy, s.capacity, s.store_threshold], hit_ratio=s.hit_ratio)
            for s in summaries]
