"""Hit ratio against capacity as a PNG (matplotlib, imported only here), and
the checks and the atomic write every ``--plot`` goes through."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.atomic_files import atomic_path
from kvtier.replay.driver import ReplayResult

DEFAULT_SUFFIX = ".png"
"""Added to a ``--plot`` path without a suffix."""


class PlotError(Exception):
    """The plot could not be made (matplotlib missing, a path it cannot write,
    or the file not written)."""


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; PlotError when missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def plot_formats() -> list[str]:
    """The file types (suffixes without the dot) matplotlib writes; PlotError
    when matplotlib is missing."""
    pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def plot_path(text: str | Path) -> Path:
    """The file ``--plot TEXT`` writes, checked before the run: TEXT, with
    ``.png`` added when it has no suffix. PlotError when TEXT names a
    directory, matplotlib cannot write its suffix, or its directory is
    missing or not writable."""
    if str(text).endswith(os.sep) or Path(text).is_dir():
        raise PlotError(f"--plot {text}: names a directory, not a file; give a file "
                        f"name, such as {Path(text) / ('plot' + DEFAULT_SUFFIX)}")
    path = Path(text)
    if not path.suffix:
        path = path.with_name(path.name + DEFAULT_SUFFIX)
    _check_format(text, path.suffix[1:].lower())
    if path.is_dir():
        raise PlotError(f"--plot {text}: {path} is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise PlotError(f"cannot write plot {path}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlotError(f"cannot write plot {path}: directory {parent} is not writable")
    return path


def _check_format(text: str | Path, suffix: str) -> None:
    """PlotError when matplotlib cannot write ``suffix`` files (``.pgf`` needs
    its TeX program on the PATH)."""
    formats = plot_formats()
    if suffix not in formats:
        raise PlotError(f"--plot {text}: matplotlib cannot write '.{suffix}' files; "
                        f"use one of {', '.join('.' + f for f in formats)}")
    if suffix == "pgf":
        import matplotlib

        tex = matplotlib.rcParams["pgf.texsystem"]
        if shutil.which(tex) is None:
            raise PlotError(f"--plot {text}: matplotlib writes .pgf files with {tex}, "
                            "which is not installed")


def save_figure(fig: Any, path: str | Path) -> None:
    """Write ``fig`` to ``path`` in the format its suffix names (PNG without one):
    to a temporary file in the same directory, then renamed over ``path``, so
    that ``path`` is never a partial file. PlotError naming the path when it
    cannot."""
    path = Path(path)
    try:
        with atomic_path(path) as temp:
            fig.savefig(temp, format=path.suffix[1:].lower() or DEFAULT_SUFFIX[1:])
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a backend's tool
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise PlotError(f"cannot write plot {path}: {reason}") from None


Spread = Mapping[tuple[str, int, int], tuple[float, float]]
"""A hit ratio's range (low, high) by policy, capacity and store threshold."""


def plot_results(results: Sequence[ReplayResult], path: str | Path, title: str = "",
                 spread: Spread | None = None) -> None:
    """One line per policy (and store threshold, when several), OPT dashed, infinite dotted.

    The x axis is the capacity in blocks (log scale); the y axis the prefix-hit
    ratio (block hits for the bounds). ``spread`` shades each point's range
    around its line (the key seeds' range around their median).
    """
    plt = pyplot()
    thresholds = {r.store_threshold for r in results if r.policy not in ("opt", "infinite")}
    lines: dict[str, list[tuple[int, float, float, float]]] = {}
    for r in results:
        if r.policy == "infinite":
            continue
        label = r.policy
        if r.policy != "opt" and len(thresholds) > 1:
            label = f"{r.policy} (threshold {r.store_threshold})"
        low, high = (spread or {}).get((r.policy, r.capacity, r.store_threshold),
                                       (r.hit_ratio, r.hit_ratio))
        lines.setdefault(label, []).append((r.capacity, r.hit_ratio, low, high))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for label, points in lines.items():
            points.sort()
            xs, ys, lows, highs = zip(*points, strict=True)
            if label == "opt":
                ax.plot(xs, ys, "k--", marker="o", label="OPT (Belady)")
                continue
            line = ax.plot(xs, ys, marker="o", label=label)[0]
            if lows != ys or highs != ys:
                ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2, lw=0)
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
