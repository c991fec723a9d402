"""The soak's plot: RSS and each bounded structure's fill against requests
(matplotlib with the Agg backend, imported only here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.replay.plot import pyplot, save_figure
from kvtier.replay.soak import Sample

MAX_LINES = 14
"""Structures drawn (the fullest ones at their peak); the rest are left out."""


def plot_soak(samples: Sequence[Sample], limits: Mapping[str, int], path: str | Path,
              title: str = "") -> None:
    """Two panels sharing the x axis (requests served): the resident set size
    in MiB, and size / bound of the structures that were ever non-empty."""
    plt = pyplot()
    xs = [s.requests for s in samples]
    peaks = {name: max(s.sizes.get(name, 0) for s in samples) / bound
             for name, bound in limits.items() if bound > 0}
    shown = sorted((n for n, p in peaks.items() if p > 0), key=lambda n: -peaks[n])[:MAX_LINES]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 7), dpi=110,
                                      gridspec_kw={"height_ratios": [1, 1.6]})
    try:
        top.plot(xs, [s.rss_bytes / 2**20 for s in samples], color="black")
        top.set_ylabel("RSS (MiB)")
        top.set_ylim(bottom=0)
        top.grid(True, alpha=0.3)
        if title:
            top.set_title(title)
        for name in shown:
            bottom.plot(xs, [s.sizes.get(name, 0) / limits[name] for s in samples],
                        label=f"{name} (<= {limits[name]:,})")
        bottom.set_ylabel("entries / stated bound")
        bottom.set_xlabel("requests")
        bottom.set_ylim(0, 1.05)
        bottom.grid(True, alpha=0.3)
        bottom.legend(fontsize=6.5, loc="lower right", ncol=2)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
