"""The soak's plot: RSS and each bounded structure's fill against requests
(matplotlib with the Agg backend, imported only here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.replay.plot import pyplot, save_figure
from kvtier.replay.soak import Sample, peaks

MAX_LINES = 14
"""Structures drawn (the fullest ones at their peak); the rest are left out."""


def plot_soak(samples: Sequence[Sample], limits: Mapping[str, int], path: str | Path,
              title: str = "") -> None:
    """Two panels sharing the x axis (requests served): the resident set size
    in MiB, and size / bound of the structures that were ever non-empty."""
    plt = pyplot()
    bounded = {name: bound for name, bound in limits.items() if bound > 0}
    fill = {name: peak / bounded[name] for name, peak in peaks(samples, bounded).items()}
    shown = sorted((n for n, p in fill.items() if p > 0), key=lambda n: -fill[n])[:MAX_LINES]
    # one pass over the samples (each one is rebuilt from the soak's columns)
    xs: list[int] = []
    rss: list[float] = []
    series: dict[str, list[float]] = {name: [] for name in shown}
    for sample in samples:
        xs.append(sample.requests)
        rss.append(sample.rss_bytes / 2**20)
        for name, values in series.items():
            values.append(sample.sizes.get(name, 0) / limits[name])
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 7), dpi=110,
                                      gridspec_kw={"height_ratios": [1, 1.6]})
    try:
        top.plot(xs, rss, color="black")
        top.set_ylabel("RSS (MiB)")
        top.set_ylim(bottom=0)
        top.grid(True, alpha=0.3)
        if title:
            top.set_title(title)
        for name, values in series.items():
            bottom.plot(xs, values, label=f"{name} (<= {limits[name]:,})")
        bottom.set_ylabel("entries / stated bound")
        bottom.set_xlabel("requests")
        bottom.set_ylim(0, 1.05)
        bottom.grid(True, alpha=0.3)
        bottom.legend(fontsize=6.5, loc="lower right", ncol=2)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
