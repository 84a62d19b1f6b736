"""The prometheus-adapter rule docs/deploy.md gives for the engine HPA: its metric is the HPA's, and
the query selects the scheduler's series only (the frontend in each pool pod exports the same
metric name; `<<.Series>>` carries no labels, so a selector only in seriesQuery would double it)."""
from __future__ import annotations

import re

import yaml

from tests.k8s.manifests import K8S, ROOT


def adapter_rules() -> list[dict]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```yaml\n(# helm install prometheus-adapter.*?)```", text, re.DOTALL)
    assert block, "docs/deploy.md has no prometheus-adapter values block"
    return yaml.safe_load(block.group(1))["rules"]["custom"]


def test_the_rule_serves_the_hpas_metric_from_the_scheduler_only():
    hpa = yaml.safe_load((K8S / "inference-pool" / "hpa.yaml").read_text())
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = adapter_rules()
    assert [r["seriesQuery"].split("{")[0].strip("'") for r in rules] == [metric]
    for rule in rules:
        assert 'container="scheduler"' in rule["seriesQuery"]
        assert re.search(r'<<\.Series>>\{<<\.LabelMatchers>>,\s*container="scheduler"\}', rule["metricsQuery"]), \
            rule["metricsQuery"]


def test_the_check_catches_a_selector_left_out_of_the_query():
    rule = dict(adapter_rules()[0], metricsQuery="sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)")
    assert not re.search(r'<<\.Series>>\{<<\.LabelMatchers>>,\s*container="scheduler"\}', rule["metricsQuery"])
