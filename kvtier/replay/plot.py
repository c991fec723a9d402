"""Hit ratio against capacity as a PNG (matplotlib, imported only here)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.replay.driver import ReplayResult


class PlotError(Exception):
    """The plot could not be made (matplotlib missing, or the file not written)."""


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; PlotError when missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    """Write ``fig`` to ``path``; PlotError naming the path when it cannot."""
    try:
        fig.savefig(path)
    except OSError as exc:
        raise PlotError(f"cannot write plot {path}: {exc.strerror or exc}") from None


def plot_results(results: Sequence[ReplayResult], path: str | Path, title: str = "") -> None:
    """One line per policy (and store threshold, when several), OPT dashed, infinite dotted.

    The x axis is the capacity in blocks (log scale); the y axis the prefix-hit
    ratio (block hits for the bounds).
    """
    plt = pyplot()
    thresholds = {r.store_threshold for r in results if r.policy not in ("opt", "infinite")}
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        if r.policy == "infinite":
            continue
        label = r.policy
        if r.policy != "opt" and len(thresholds) > 1:
            label = f"{r.policy} (threshold {r.store_threshold})"
        lines.setdefault(label, []).append((r.capacity, r.hit_ratio))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for label, points in lines.items():
            points.sort()
            xs, ys = zip(*points, strict=True)
            if label == "opt":
                ax.plot(xs, ys, "k--", marker="o", label="OPT (Belady)")
            else:
                ax.plot(xs, ys, marker="o", label=label)
        for r in results:
            if r.policy == "infinite":
                ax.axhline(r.hit_ratio, color="grey", linestyle=":",
                           label=f"infinite cache ({r.hit_ratio:.3f})")
        ax.set_xscale("log")
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("prefix-hit ratio")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        if title:
            ax.set_title(title)
        ax.legend(fontsize="small")
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
