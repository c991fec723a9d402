"""The Grafana dashboard (docs/grafana-kvtier.json) and the Prometheus alert
rules (docs/prometheus-kvtier-alerts.yaml) an operator copies: every metric
their PromQL names is one kvtier (or vLLM, for its own offloading and prompt
token series) really exports, under the name Prometheus's text format gives
it (counters ``_total``, histograms ``_bucket``/``_sum``/``_count``), and used
as its type allows (``rate()`` and ``increase()`` over counters only, never
over a gauge). Checked against ``metric_definitions`` and against the text a
real vLLM metrics registry exposes for a kvtier engine with disk and Redis
tiers."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).parent.parent
DASHBOARD = REPO / "docs" / "grafana-kvtier.json"
ALERTS = REPO / "docs" / "prometheus-kvtier-alerts.yaml"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm(-cpu)")

VLLM_ENGINE_METRICS = {
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached_by_source": "counter",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
}
"""vLLM's own engine series the dashboard and alerts use besides the offloading
ones (``tests/test_serve_e2e.py`` finds each on a real server's /metrics)."""

SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
"""What Prometheus's text format appends to a family's name, by type."""
COUNTER_FUNCS = {"rate", "irate", "increase"}
"""Functions that read a range of a counter (a gauge under them is meaningless)."""

GROUPINGS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
"""Keywords whose parentheses hold label names, not an expression."""

_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`|\{[^}]*\}|\[[^\]]*\]'
                    r"|[A-Za-z_:][A-Za-z0-9_:]*|\(|\)|\S")


@dataclass(frozen=True)
class Use:
    """One metric named in a PromQL expression."""

    name: str
    functions: tuple[str, ...]
    """Named calls around it, outermost first (``by (...)`` groups left out)."""
    has_range: bool
    """Followed by a range selector (``[5m]``)."""


def metric_uses(expr: str) -> Iterator[Use]:
    """The ``vllm:...`` metrics ``expr`` names, each with the calls around it.
    Strings, label matchers and range selectors are skipped whole, so a
    Grafana variable or a label value never reads as a metric."""
    tokens = _TOKEN.findall(expr)
    stack: list[str | None] = []
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok == "(":
            prev = tokens[i - 1] if i else ""
            named = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prev) and prev not in GROUPINGS
            stack.append(prev if named else None)
        elif tok == ")":
            if stack:
                stack.pop()
        elif tok.startswith("vllm:") and nxt != "(":
            after = tokens[i + 2] if nxt.startswith("{") and i + 2 < len(tokens) else nxt
            yield Use(tok, tuple(f for f in stack if f), after.startswith("["))


def catalog() -> dict[str, str]:
    """Every family a kvtier engine's /metrics can hold that the checks know,
    name -> type: kvtier's and vLLM's CPU offloading ones (``metric_definitions``),
    vLLM's connector transfer ones, and VLLM_ENGINE_METRICS."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics as vm
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    from kvtier.vllm.metrics import metric_definitions

    defs = {**metric_definitions({"store_threshold": 2}), **vm.get_connector_metric_definitions(),
            **vm._DEPRECATED_CONNECTOR_METRIC_DEFINITIONS}
    out = dict(VLLM_ENGINE_METRICS)
    for name, meta in defs.items():
        out[name] = ("counter" if isinstance(meta, OffloadingCounterMetadata) else
                     "gauge" if isinstance(meta, OffloadingGaugeMetadata) else "histogram")
    return out


def family_of(name: str, families: dict[str, str]) -> tuple[str, str] | None:
    """(family, type) whose exposed sample ``name`` is, or None."""
    for family, kind in families.items():
        base = family.removesuffix("_total") if kind == "counter" else family
        if any(base + suffix == name for suffix in SUFFIXES[kind]):
            return family, kind
    return None


def problems(expr: str, families: dict[str, str]) -> list[str]:
    """What is wrong with the metrics ``expr`` names: unknown names, a missing
    or wrong suffix, a counter read other than through rate/irate/increase over
    a range, a gauge under one of them."""
    out = []
    uses = list(metric_uses(expr))
    if not uses:
        out.append(f"names no vllm: metric: {expr}")
    for use in uses:
        found = family_of(use.name, families)
        if found is None:
            hint = (f" (a {families[use.name]}: exposed with a suffix)"
                    if use.name in families else "")
            out.append(f"{use.name}: not exported{hint}")
            continue
        kind = found[1]
        inner = use.functions[-1] if use.functions else ""
        if kind == "gauge" and COUNTER_FUNCS & set(use.functions):
            out.append(f"{use.name}: a gauge under {'/'.join(sorted(COUNTER_FUNCS))}")
        if kind != "gauge" and not (inner in COUNTER_FUNCS and use.has_range):
            out.append(f"{use.name}: a {kind} read without rate/irate/increase over a range")
    return out


def dashboard_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard_panels(dash) for t in p.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    import yaml

    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def all_exprs() -> list[str]:
    return dashboard_exprs(json.loads(DASHBOARD.read_text())) + [
        " ".join(str(r["expr"]).split()) for r in alert_rules()]


def test_the_dashboard_is_a_grafana_dashboard_with_titled_panels_and_units() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"model_name", "engine"} <= set(variables)  # vLLM's labels on every series
    panels = [p for p in dashboard_panels(dash) if p["type"] != "row"]
    assert len(panels) >= 15
    ids = [p["id"] for p in dashboard_panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p.get("title"), p
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            # every series is narrowed to the chosen model and engine
            assert t["expr"].count('model_name=~"$model_name"') == len(list(
                metric_uses(t["expr"]))), (p["title"], t["expr"])
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_every_alert_rule_is_complete() -> None:
    rules = alert_rules()
    assert len(rules) >= 5
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]


@needs_vllm
def test_every_metric_the_dashboard_and_alerts_name_is_exported_and_used_by_type() -> None:
    families = catalog()
    found = {p for expr in all_exprs() for p in problems(expr, families)}
    assert found == set()
    named = {u.name for expr in all_exprs() for u in metric_uses(expr)}
    # the panels the operator needs are there
    for name in ("vllm:kvtier_hits_total", "vllm:kvtier_tier_read_ms_total",
                 "vllm:kvtier_tier_available", "vllm:kvtier_dropped_writes_total",
                 "vllm:kvtier_promotion_timeouts_total", "vllm:kvtier_pinned",
                 "vllm:kvtier_tier_corrupt_total", "vllm:kvtier_events_dropped_total",
                 "vllm:prompt_tokens_cached_by_source_total"):
        assert name in named, name


@needs_vllm
@pytest.mark.parametrize(("expr", "wrong"), [
    ("sum(rate(vllm:kvtier_hit_total[5m]))", "not exported"),  # misspelt
    ("rate(vllm:kvtier_hits[5m])", "exposed with a suffix"),  # no _total
    ("rate(vllm:kvtier_pinned[5m])", "a gauge under"),
    ("vllm:kvtier_pinned_total", "not exported"),  # a gauge has no _total
    ("sum(vllm:kvtier_stores_total)", "without rate"),  # a raw counter
    ("rate(vllm:kvtier_tier_hits_total)", "without rate"),  # no range
    ("sum by (tier) (increase(vllm:kvtier_tier_available[1h]))", "a gauge under"),
    ('label_replace(vllm:kvtier_resident, "x", "$1", "tier", "(.*)") + '
     "rate(vllm:kvtier_nope_total[5m])", "vllm:kvtier_nope_total: not exported"),
    ("rate(vllm:kv_offload_size[5m])", "not exported"),  # a histogram needs _count...
])
def test_a_wrong_name_or_type_is_caught(expr: str, wrong: str) -> None:
    """Negative controls: each expression names a metric wrongly."""
    found = problems(expr, catalog())
    assert any(wrong in p for p in found), found


@needs_vllm
def test_right_names_pass_the_same_checks() -> None:
    families = catalog()
    for expr in ('sum by (tier) (rate(vllm:kvtier_tier_hits_total{tier="disk"}[5m]))',
                 "histogram_quantile(0.9, sum by (le) (rate(vllm:kv_offload_size_bucket[5m])))",
                 "max_over_time(vllm:kvtier_pinned[10m]) > 0",
                 "resets(vllm:kvtier_tier_available[$__range])"):
        assert problems(expr, families) == [], expr


@needs_vllm
def test_a_misspelt_metric_in_the_dashboard_fails_the_check() -> None:
    """Negative control on the document itself: one panel's metric renamed
    (the old name of kvtier's promotions counter, singular) is reported."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dash)
    target = next(e for e in exprs if "vllm:kvtier_promotions_total" in e)
    wrong = target.replace("vllm:kvtier_promotions_total", "vllm:kvtier_promotion_total")
    assert problems(wrong, catalog()) == ["vllm:kvtier_promotion_total: not exported"]


def _exposition(tmp_path: Path, redis_url: str) -> tuple[str, dict[str, str]]:
    """The /metrics text vLLM's real offloading metrics (``OffloadPromMetrics``,
    labels model_name and engine as vLLM's stat logger gives them) show for a
    kvtier engine with a disk and a Redis tier after its first step, and the
    registry's families (name without ``_total`` -> type), those without a
    sample yet included."""
    import prometheus_client as prom
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    from kvtier import OffloadManager
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers import KVLayout
    from kvtier.tiers.cascade import TierCascade
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.redis_tier import RedisTier
    from kvtier.vllm.adapter import KVTierOffloadingManager

    registry = prom.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (prom.Counter, prom.Gauge, prom.Histogram)}
    spec = {"spec_name": "KVTierSpec", "spec_module_path": "kvtier.vllm",
            "cpu_bytes_to_use": 1, "store_threshold": 2}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=spec))
    metrics = OffloadPromMetrics(config, types, ["model_name", "engine"],  # type: ignore[arg-type]
                                 {0: ["m", "0"]})
    ns = KVLayout("m", "bfloat16", 16, 2, 2, 64).namespace()
    disk = DiskTier(tmp_path / "disk", ns, 64 << 20, free_reserve_bytes=0, enable_events=True)
    redis = RedisTier(redis_url, ns, socket_timeout_s=2.0, connect_timeout_s=1.0,
                      enable_events=True)
    with SlotRegion.create("dashboard", 8, 4096, shm_dir=tmp_path) as region:
        manager = OffloadManager(8, policy="default", store_threshold=2)
        cascade = TierCascade(manager, region, [disk, redis])
        adapter = KVTierOffloadingManager(cascade.manager, cascade)
        try:
            metrics.observe(adapter.get_stats().data)
        finally:
            adapter.shutdown()
    families = {f.name: f.type for f in registry.collect()}
    return prom.generate_latest(registry).decode(), families


@needs_vllm
def test_the_kvtier_names_are_on_a_real_exposition(tmp_path: Path, redis_server: Any) -> None:
    """Each ``vllm:kvtier_*`` sample the dashboard and alerts name is in the
    text vLLM's own registry exposes for kvtier (disk and Redis tiers), suffix
    and all; vLLM's offloading families (no sample until a transfer) are
    declared there with the type the checks assumed."""
    from kvtier import prom

    text, declared = _exposition(tmp_path, redis_server.url)
    samples = {name for name, _ in prom.parse(text)}
    families = catalog()
    for name in sorted({u.name for e in all_exprs() for u in metric_uses(e)}):
        if name.startswith("vllm:kvtier_"):
            assert name in samples, name
        elif name.startswith("vllm:kv_offload_"):
            family = family_of(name, families)
            assert family is not None, name
            assert declared.get(family[0].removesuffix("_total")) == family[1], name


@needs_vllm
def test_a_breaker_that_opened_and_closed_between_two_steps_is_counted(
        tmp_path: Path, redis_server: Any) -> None:
    """The dashboard's "breaker openings" panel and the flapping alert: a Redis
    breaker that opened and closed again between two engine steps (its probe
    succeeded within reset_timeout_s) left ``vllm:kvtier_tier_available`` at 1
    in both steps' stats, so no scrape saw it; the tier counted the opening
    (``breaker_opens``) but kvtier did not export it. It is now a counter."""
    from kvtier import OffloadManager
    from kvtier.slots.region import SlotRegion
    from kvtier.tiers import KVLayout
    from kvtier.tiers.cascade import TierCascade
    from kvtier.tiers.redis_tier import RedisTier
    from kvtier.vllm.adapter import KVTierOffloadingManager

    ns = KVLayout("m", "bfloat16", 16, 2, 2, 64).namespace()
    redis = RedisTier(redis_server.url, ns, socket_timeout_s=1.0, connect_timeout_s=0.5,
                      failure_threshold=1, reset_timeout_s=0.05)
    opens, available = "vllm:kvtier_tier_breaker_opens", "vllm:kvtier_tier_available"

    def step(adapter: Any) -> dict[str, Any]:
        data = adapter.get_stats().data["data"]
        return {name: data.get(name, {}).get(("redis",)) for name in (opens, available)}

    with SlotRegion.create("dashboard-breaker", 8, 4096, shm_dir=tmp_path) as region:
        cascade = TierCascade(OffloadManager(8), region, [redis])
        adapter = KVTierOffloadingManager(cascade.manager, cascade)
        try:
            assert step(adapter) == {opens: 0, available: 1}
            redis_server.stop()
            assert redis.contains([b"k" * 16]) == [False]  # fails: the breaker opens
            assert redis.breaker.state == "open"
            redis_server.start()
            time.sleep(0.1)  # past reset_timeout_s: the next call probes
            assert redis.contains([b"k" * 16]) == [False]  # the probe closes it
            assert redis.breaker.state == "closed"
            assert step(adapter) == {opens: 1, available: 1}
        finally:
            adapter.shutdown()
