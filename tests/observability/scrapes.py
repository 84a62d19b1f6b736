"""Reading Prometheus text in end-to-end tests: one scrape as a dict, one sample, a poll with a deadline."""
from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, tuple[str, dict]]:
    """name -> (type, {sample name + labels: value}) from Prometheus text."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    return {family.name: (family.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples})
            for family in text_string_to_metric_families(text)}


def value(metrics: dict, family: str, sample: str, **labels) -> float:
    _, samples = metrics[family]
    matches = [v for (name, lbls), v in samples.items() if name == sample and labels.items() <= dict(lbls).items()]
    assert len(matches) == 1, (sample, labels, samples)
    return matches[0]


def poll_until(read, is_done, what: str, timeout_s: float = 15.0):
    """Calls `read()` until `is_done(result)`; returns that result, or raises with the last one."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = read()
        if is_done(got):
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s; last: {got}")
        time.sleep(0.1)


ENGINE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "engine_steps")


def engine_counters(metrics: dict, model_name: str) -> dict[str, float | None]:
    """The engine's counters in a scrape; None for one not there (the frontend has not heard yet)."""
    counters = {}
    for name in ENGINE_COUNTERS:
        _, samples = metrics.get(f"spindle:{name}", ("counter", {}))
        found = [v for (sample, labels), v in samples.items()
                 if sample == f"spindle:{name}_total" and dict(labels).get("model_name") == model_name]
        counters[name] = found[0] if len(found) == 1 else None
    return counters
