"""Prometheus text from a server's ``/metrics``, as ``{(name, labels): value}``."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

ENGINE_LABELS = ("engine", "model_name")
"""Labels vLLM puts on every sample; dropped so samples compare across servers."""


def parse(text: str, drop: Iterable[str] = ENGINE_LABELS) -> Samples:
    """Samples of a Prometheus text exposition, labels sorted, ``drop`` removed."""
    from prometheus_client.parser import text_string_to_metric_families

    dropped = set(drop)
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in dropped))
            key = (s.name, labels)
            out[key] = out.get(key, 0.0) + float(s.value)
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
