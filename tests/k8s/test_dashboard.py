"""The Grafana dashboard: valid, complete, and built only on Spindle's metric names (vLLM's set
under the `spindle:` prefix)."""
from __future__ import annotations

import json
import re

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, rendered

DASHBOARD = K8S / "observability" / "dashboards" / "spindle.json"
HISTOGRAMS = {
    "spindle:time_to_first_token_seconds",
    "spindle:inter_token_latency_seconds",
    "spindle:time_per_output_token_seconds",
    "spindle:e2e_request_latency_seconds",
    "spindle:request_queue_time_seconds",
}
GAUGES = {"spindle:num_requests_running", "spindle:num_requests_waiting", "spindle:kv_cache_usage_perc"}
COUNTERS = {
    "spindle:prefix_cache_queries_total",
    "spindle:prefix_cache_hits_total",
    "spindle:num_preemptions_total",
    "spindle:prompt_tokens_total",
    "spindle:generation_tokens_total",
    "spindle:request_success_total",
}
KNOWN = GAUGES | COUNTERS | {f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("bucket", "sum", "count")}
# Every metric but the alias time_per_output_token_seconds is charted.
REQUIRED = (KNOWN - {m for m in KNOWN if "time_per_output_token" in m or m.endswith(("_sum", "_count"))})
REQUIRED_PANELS = ("Time to first token", "Inter-token latency", "Token throughput", "Requests waiting",
                   "KV cache usage", "Prefix cache hit rate", "Preemptions")
METRIC = re.compile(r"\b([a-z0-9_]+:[a-z0-9_]+)\b")


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard):
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _exprs(dashboard):
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_dashboard_identity(dashboard):
    assert dashboard["uid"] and dashboard["title"] == "Spindle"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_uses_only_known_spindle_metrics(dashboard):
    used = {m for expr in _exprs(dashboard) for m in METRIC.findall(expr)}
    assert used <= KNOWN, f"unknown metric names: {used - KNOWN}"
    assert not [m for m in used if not m.startswith("spindle:")]


def test_charts_every_metric(dashboard):
    used = {m for expr in _exprs(dashboard) for m in METRIC.findall(expr)}
    assert REQUIRED <= used, f"not charted: {sorted(REQUIRED - used)}"


def test_has_the_required_panels(dashboard):
    titles = {p["title"] for p in _panels(dashboard)}
    assert set(REQUIRED_PANELS) <= titles, set(REQUIRED_PANELS) - titles


def test_panels_query_the_datasource_variable(dashboard):
    assert any(v["name"] == "datasource" and v["type"] == "datasource" for v in dashboard["templating"]["list"])
    for panel in _panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], target["expr"]


def test_histograms_are_read_through_quantiles(dashboard):
    for expr in _exprs(dashboard):
        for metric in METRIC.findall(expr):
            if metric.endswith("_bucket"):
                assert "histogram_quantile" in expr and "by (le)" in expr, expr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shipped_as_a_grafana_config_map(overlay, dashboard):
    config_map = rendered(overlay).get("ConfigMap", "spindle-grafana-dashboard")
    assert config_map is not None
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["spindle.json"]) == dashboard
