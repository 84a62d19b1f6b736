"""The scheduler's Prometheus metrics: the engine's queue and KV cache state, read at scrape time.

Nothing is recorded per step: the collector asks the engine core for its stats when Prometheus
scrapes (on the scheduler's own loop, see services/common/metrics_server.py). Per-request latency
histograms live in the frontend, which sees every token arrive (services/frontend/metrics.py).
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.messages import SchedulerStats
from services.common.metrics import PREFIX, EngineStatsCollector
from services.scheduler.engine_core import EngineCore


class _WorkerAliveCollector(Collector):
    def __init__(self, engine: EngineCore):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(PREFIX + "engine_worker_alive", "1 while the scheduler's worker is connected.")
        family.add_metric([], 1.0 if self.engine.is_worker_alive else 0.0)
        yield family


def scheduler_registry(engine: EngineCore) -> CollectorRegistry:
    """A registry of its own (never the process-global one), so tests can run several engines."""

    def read() -> tuple[SchedulerStats, str] | None:
        if engine.info is None:
            return None  # no worker yet: the model name (and the cache size) is still unknown
        return engine.get_stats(), engine.info.model_name

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(read))
    registry.register(_WorkerAliveCollector(engine))
    return registry
