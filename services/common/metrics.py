"""Prometheus names and buckets shared by the services: vLLM's metric set under the `spindle:` prefix.

Histogram buckets follow the OpenTelemetry GenAI semantic conventions (gen_ai.server.*), so our
quantiles line up with other GenAI servers' dashboards. Every metric carries `model_name`, as vLLM's
do (the Grafana dashboard filters on it).

The engine's queue and cache state (`SchedulerStats`) is exported by a collector that reads the
latest stats when Prometheus scrapes: nothing is recorded on the engine's hot path. The scheduler
exports its own stats; the frontend exports the copy it receives with every step's outputs, because
the Gateway API Inference Extension's endpoint picker scrapes the frontend's port only.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from services.common.messages import SchedulerStats

PREFIX = "spindle:"

# gen_ai.server.time_to_first_token
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# gen_ai.server.time_per_output_token (also used for the inter-token latency)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# gen_ai.server.request.duration (also end-to-end, queue, prefill, decode and step times)
DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# gen_ai.client.token.usage
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)

# `_created` series double every counter for no use to a dashboard (vLLM turns them off too).
disable_created_metrics()


def engine_stats_families(stats: SchedulerStats, model_name: str) -> list[Metric]:
    """The engine's gauges and cumulative counters, as the Model Server Protocol and vLLM name them."""
    labels = ["model_name"]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        family.add_metric([model_name], value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=labels)  # exposed as <name>_total
        family.add_metric([model_name], value)
        return family

    return [
        gauge("num_requests_running", "Requests in the engine's running set.", stats.num_running_reqs),
        gauge("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).",
              stats.num_waiting_reqs),
        gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0 to 1.", stats.kv_cache_usage),
        gauge("num_kv_cache_blocks", "Usable KV cache blocks of the engine.", stats.num_total_blocks),
        counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
        counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
        counter("num_preemptions", "Requests preempted (recomputed later) by the scheduler.", stats.num_preemptions),
        counter("engine_steps", "Engine steps run.", stats.num_steps),
    ]


class EngineStatsCollector(Collector):
    """Reads the current stats at scrape time; `read` returns (stats, model name) or None before the
    engine is known (then nothing is exported rather than zeros that would look like an idle engine)."""

    def __init__(self, read: Callable[[], tuple[SchedulerStats, str] | None]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        current = self._read()
        if current is not None:
            yield from engine_stats_families(*current)


class WeightedHistogram(Collector):
    """A histogram with one label set that takes `count` observations of one value at once
    (prometheus_client's Histogram observes one at a time): a step's inter-token latencies mostly
    share one value, so a step costs one bucket update instead of one per request."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], labels: dict[str, str],
                 registry: CollectorRegistry):
        self.name, self.documentation, self.labels = name, documentation, labels
        self.upper_bounds = (*buckets, float("inf")) if buckets[-1] != float("inf") else tuple(buckets)
        self.bucket_counts = [0] * len(self.upper_bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.bucket_counts[bisect.bisect_left(self.upper_bounds, value)] += count
        self.sum += value * count

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        cumulative, buckets = 0, []
        for bound, num in zip(self.upper_bounds, self.bucket_counts):
            cumulative += num
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(list(self.labels.values()), buckets, self.sum)
        yield family
