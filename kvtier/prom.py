"""Prometheus text from a server's ``/metrics``, as ``{(name, labels): value}``."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

ENGINE_LABELS = ("engine", "model_name")
"""Labels vLLM puts on every sample; dropped so samples compare across servers."""

MEAN_GAUGES = frozenset({
    "vllm:kvtier_usage_ratio", "vllm:kvtier_policy_history_factor",
    "vllm:kvtier_policy_admission", "vllm:kvtier_policy_recency",
    "vllm:kvtier_policy_admission_evidence",
    "vllm:kvtier_tier_available",
})
"""kvtier's gauges that are a ratio, a setting or a 0/1 switch of one engine, not
an amount: a data-parallel server's engines (``engine="0"``, ``"1"``...) merge
into their mean, not their sum. So does every gauge named ``*_perc`` or
``*_ratio`` (vLLM's cache usage fractions)."""


def _merged_by_mean(family_type: str, name: str) -> bool:
    """Whether samples of ``name`` that differ only in dropped labels merge into
    their mean: non-additive gauges. Counts (resident, pinned, leased, requests
    running), counters and histograms add up."""
    return family_type == "gauge" and (
        name in MEAN_GAUGES or name.endswith(("_perc", "_ratio")))


COPY_LABELS = ("pid",)
"""The label of a gauge's copies on a server with several API server processes
(``--api-server-count``, by default the data-parallel size): each process
shows its own copy of an engine's gauge, as of the last step whose stats it
received. Always merged, by their mean: adding them up would count the
engine once per API server."""


def parse(text: str, drop: Iterable[str] = ENGINE_LABELS) -> Samples:
    """Samples of a Prometheus text exposition, labels sorted, ``drop`` removed.

    First each gauge's copies (``COPY_LABELS``) merge into their mean. Then
    samples that differ only in a dropped label (the engines of a
    data-parallel server) merge: summed, except the gauges ``_merged_by_mean``
    names (a ratio, a setting, a switch), whose mean is taken (their sum would
    read as a ratio above 1, or a switch at 2), and ``*_created`` timestamps,
    whose earliest is kept. Memory: a few entries per sample."""
    from prometheus_client.parser import text_string_to_metric_families

    copies: dict[tuple[str, Labels], list[float]] = {}
    by_mean: set[str] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in COPY_LABELS))
            copies.setdefault((s.name, labels), []).append(float(s.value))
            if _merged_by_mean(family.type, s.name):
                by_mean.add(s.name)
    return _merge(copies, set(drop), by_mean)


def _merge(copies: Mapping[tuple[str, Labels], list[float]], dropped: set[str],
           by_mean: set[str]) -> Samples:
    """``copies`` (each key's values: one, or one per API server) without the
    ``dropped`` labels, merged as ``parse`` says."""
    out: Samples = {}
    merged: dict[tuple[str, Labels], int] = {}
    for (name, labels), values in copies.items():
        value = sum(values) / len(values)
        key = (name, tuple((k, v) for k, v in labels if k not in dropped))
        if key not in out:
            out[key] = value
        elif name.endswith("_created"):
            out[key] = min(out[key], value)
        else:
            out[key] += value
        merged[key] = merged.get(key, 0) + 1
    for key, n in merged.items():
        if key[0] in by_mean:
            out[key] /= n
    return out


def scrape(base_url: str, timeout_s: float = 10.0) -> Samples:
    """The samples at ``base_url``/metrics."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        return parse(r.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels`` (0.0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def by_label(samples: Samples, name: str, label: str) -> Mapping[str, float]:
    """``name``'s samples summed per value of ``label``."""
    out: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == name:
            key = dict(ls).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out
