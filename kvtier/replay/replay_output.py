"""How ``kvtier replay`` prints its results: aligned text tables (alone, or
behind an engine cache with ``--gpu-blocks``) or JSON lines, one row per
replay as it finishes, and the medians over several key seeds
(``kvtier.replay.seeds``) at the end.

Every formatter has ``header()`` (None for JSON), ``row(result, seed)`` and
``summary(summaries)``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvtier.replay.driver import BOUNDS, ReplayResult
from kvtier.replay.seeds import SeedSummary, seeds_label

SEED_COLUMN = "key seed"
"""The first column's title when several key seeds run."""


class _Columns:
    """Aligned text rows under ``columns``, widths fixed up front so rows print
    as runs finish; a leading key-seed column when several key seeds run, and
    the summary over them (``kvtier.replay.seeds``)."""

    columns: tuple[str, ...] = ()

    def __init__(self, values: Sequence[int], key_seeds: Sequence[int]) -> None:
        self.seed_width = (max(len(SEED_COLUMN), len(str(max(key_seeds))))
                           if len(key_seeds) > 1 else 0)
        self.widths = [max(len(h), v) for h, v in zip(self.columns, values, strict=True)]

    def header(self) -> str | None:
        """Column titles."""
        return self._line(self.columns[0], self.columns[1:], SEED_COLUMN)

    def _line(self, first: str, cells: Sequence[str], seed: str) -> str:
        line = _aligned(first, cells, self.widths)
        return f"{seed.rjust(self.seed_width)}  {line}" if self.seed_width else line

    def summary(self, summaries: Sequence[SeedSummary]) -> list[str]:
        """The median over the key seeds: a title, column titles, one line each."""
        s0 = summaries[0]
        titles = ["policy", "capacity", "threshold", "median", "min", "max",
                  f"x {s0.baseline}", "min", "max"]
        rows = [[s.policy, str(s.capacity), str(s.store_threshold), f"{s.hit_ratio:.4f}",
                 f"{s.hit_ratio_min:.4f}", f"{s.hit_ratio_max:.4f}",
                 *(_times(v) for v in (s.vs_baseline, s.vs_min, s.vs_max))]
                for s in summaries]
        widths = [max(len(t), *(len(row[i]) for row in rows)) for i, t in enumerate(titles)]
        return [f"median over key seeds {seeds_label(s0.key_seeds)}; x {s0.baseline}: "
                f"the hit ratio over {s0.baseline}'s under the same seed",
                *(_aligned(row[0], row[1:], widths) for row in [titles, *rows])]


def _aligned(first: str, cells: Sequence[str], widths: Sequence[int]) -> str:
    """``first`` left-aligned, ``cells`` right-aligned, to ``widths``."""
    return "  ".join([first.ljust(widths[0])] + [
        c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)])


def _times(ratio: float | None) -> str:
    """A ratio to another policy's hit ratio, or '-' where it had none."""
    return "-" if ratio is None else f"{ratio:.3f}"


class Table(_Columns):
    """One replay per line: hit ratio, stores, evictions, manager time per key."""

    columns = ("policy", "capacity", "threshold", "hit ratio", "stores", "evictions",
               "us/key")

    def __init__(self, policies: Sequence[str], capacities: Sequence[int],
                 thresholds: Sequence[int], max_count: int,
                 key_seeds: Sequence[int] = (0,)) -> None:
        super().__init__((max(map(len, policies)), len(str(max(capacities))),
                          len(str(max(thresholds))), 6, len(str(max_count)),
                          len(str(max_count)), 8), key_seeds)

    def row(self, r: ReplayResult, seed: int | None = None) -> str:
        """One result, hit ratio to 4 decimals (``seed`` None: a bound's, any seed)."""
        us = "-" if r.policy in BOUNDS else f"{r.us_per_key:.3f}"
        cells = (str(r.capacity), str(r.store_threshold), f"{r.hit_ratio:.4f}",
                 str(r.stores), str(r.evictions), us)
        return self._line(r.policy, cells, "-" if seed is None else str(seed))


class GpuTable(_Columns):
    """``--gpu-blocks`` rows: kvtier's CPU-tier hit ratio behind the engine cache,
    the engine cache's own and the combined one; widths fixed up front."""

    columns = ("policy", "capacity", "threshold", "cpu-tier hit", "engine hit", "combined",
               "stores", "evictions", "us/key")

    def __init__(self, policies: Sequence[str], capacities: Sequence[int],
                 thresholds: Sequence[int], max_count: int,
                 key_seeds: Sequence[int] = (0,)) -> None:
        super().__init__((max(map(len, policies)), len(str(max(capacities))),
                          len(str(max(thresholds))), 6, 6, 6, len(str(max_count)),
                          len(str(max_count)), 8), key_seeds)

    def row(self, r: ReplayResult, seed: int | None = None) -> str:
        """One result, ratios to 4 decimals (``seed`` None: a bound's, any seed)."""
        gpu_ratio = getattr(r, "gpu_hit_ratio", 0.0)
        combined = getattr(r, "combined_hit_ratio", r.hit_ratio)
        us = "-" if r.policy in BOUNDS else f"{r.us_per_key:.3f}"
        cells = (str(r.capacity), str(r.store_threshold), f"{r.hit_ratio:.4f}",
                 f"{gpu_ratio:.4f}", f"{combined:.4f}", str(r.stores), str(r.evictions), us)
        return self._line(r.policy, cells, "-" if seed is None else str(seed))


class JsonLines:
    """One JSON object per result, with the trace path; no header."""

    def __init__(self, path: Path) -> None:
        self.trace = str(path)

    def header(self) -> str | None:
        """JSON lines have no header."""
        return None

    def row(self, r: ReplayResult, seed: int | None = None) -> str:
        """The result's fields, its key seed (None: a bound's, the same under
        every seed) and the trace path as one JSON object."""
        return json.dumps({**r.to_dict(), "key_seed": seed, "trace": self.trace})

    def summary(self, summaries: Sequence[SeedSummary]) -> list[str]:
        """One object per summary over the key seeds, ``"summary": "key_seeds"``."""
        return [json.dumps({"summary": "key_seeds", **s.to_dict(), "trace": self.trace})
                for s in summaries]
