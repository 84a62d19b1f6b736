"""The frontend's metrics from synthetic step outputs: exact phase times, counts and engine gauges."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.common.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    RequestEvent,
    RequestEventType,
    SchedulerStats,
)
from services.common.metrics import WeightedHistogram
from services.frontend.metrics import FrontendMetrics
from tests.step_outputs import outputs_from

MODEL = {"model_name": "m"}


def step(timestamp: float, *outputs: EngineCoreOutput) -> EngineCoreOutputs:
    """One step's outputs as the scheduler sends them: extras only where an output carries more."""
    return outputs_from(list(outputs), timestamp=timestamp)


def sample(metrics: FrontendMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {**MODEL, **labels})


@pytest.fixture
def metrics():
    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=3, kv_cache_usage=0.25, prefix_cache_queries=40,
                           prefix_cache_hits=16, num_preemptions=1, num_total_blocks=100, num_steps=9)
    return FrontendMetrics("m", SimpleNamespace(info=object(), last_stats=stats))


def test_a_finished_request_records_its_phases(metrics):
    t0 = 1000.0
    metrics.track("a", num_prompt_tokens=10, arrival_s=0.0)
    metrics.on_step(step(t0 + 0.5, EngineCoreOutput("a", [], events=[
        RequestEvent(RequestEventType.QUEUED, t0), RequestEvent(RequestEventType.SCHEDULED, t0 + 0.5)])))
    metrics.on_step(step(t0 + 0.75, EngineCoreOutput("x", [1]), EngineCoreOutput("a", [5])))  # x: not ours
    assert sample(metrics, "spindle:prompt_tokens_total") == 10  # counted once prefill is done
    metrics.on_step(step(t0 + 1.0, EngineCoreOutput("a", [6])))
    metrics.on_step(step(t0 + 1.25, EngineCoreOutput("a", [7], finish_reason=FinishReason.LENGTH)))
    times = metrics.finish("a", "length")

    assert (times.queue_time_s, times.prefill_time_s, times.decode_time_s) == (0.5, 0.25, 0.5)
    assert sample(metrics, "spindle:request_queue_time_seconds_sum") == 0.5
    assert sample(metrics, "spindle:request_prefill_time_seconds_sum") == 0.25
    assert sample(metrics, "spindle:request_decode_time_seconds_sum") == 0.5
    assert sample(metrics, "spindle:request_inference_time_seconds_sum") == 0.75
    assert sample(metrics, "spindle:generation_tokens_total") == 3
    assert sample(metrics, "spindle:time_to_first_token_seconds_count") == 1
    assert sample(metrics, "spindle:inter_token_latency_seconds_count") == 2
    assert sample(metrics, "spindle:time_per_output_token_seconds_count") == 1
    assert sample(metrics, "spindle:e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "spindle:request_generation_tokens_sum") == 3
    assert sample(metrics, "spindle:request_prompt_tokens_bucket", le="16.0") == 1
    assert sample(metrics, "spindle:request_success_total", finished_reason="length") == 1
    assert metrics.num_inflight == 0


def test_an_aborted_request_counts_its_tokens_but_no_latencies(metrics):
    metrics.track("b", num_prompt_tokens=4, arrival_s=0.0)
    metrics.on_step(step(5.0, EngineCoreOutput("b", [9])))
    metrics.finish("b", "abort")
    metrics.on_step(step(6.0, EngineCoreOutput("b", [10])))  # arrives after the request left: ignored
    assert sample(metrics, "spindle:request_success_total", finished_reason="abort") == 1
    assert sample(metrics, "spindle:generation_tokens_total") == 1
    assert sample(metrics, "spindle:time_to_first_token_seconds_count") == 1  # it did get a first token
    assert sample(metrics, "spindle:e2e_request_latency_seconds_count") == 0
    assert metrics.finish("b", "abort") is None  # finishing twice does not count twice
    assert sample(metrics, "spindle:request_success_total", finished_reason="abort") == 1


def test_engine_state_is_read_at_scrape_time(metrics):
    assert sample(metrics, "spindle:num_requests_running") == 2
    assert sample(metrics, "spindle:num_requests_waiting") == 3
    assert sample(metrics, "spindle:kv_cache_usage_perc") == 0.25
    assert sample(metrics, "spindle:prefix_cache_queries_total") == 40
    assert sample(metrics, "spindle:prefix_cache_hits_total") == 16
    assert sample(metrics, "spindle:num_preemptions_total") == 1
    never_connected = FrontendMetrics("m", SimpleNamespace(info=None, last_stats=SchedulerStats()))
    assert sample(never_connected, "spindle:num_requests_running") is None  # no zeros for an unknown engine


def test_buckets_follow_the_genai_conventions(metrics):
    from services.common.metrics import DURATION_BUCKETS_S, TPOT_BUCKETS_S, TTFT_BUCKETS_S

    assert TTFT_BUCKETS_S[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS_S[-1] == 10.0
    assert TPOT_BUCKETS_S[0] == 0.01 and TPOT_BUCKETS_S[-1] == 2.5
    assert DURATION_BUCKETS_S == tuple(0.01 * 2**i for i in range(14))
    metrics.track("c", 1, 0.0)
    metrics.on_step(step(1.0, EngineCoreOutput("c", [1])))
    bounds = {float(s.labels["le"]) for f in metrics.registry.collect() if f.name == "spindle:time_to_first_token_seconds"
              for s in f.samples if s.name.endswith("_bucket")}
    assert bounds == set(TTFT_BUCKETS_S) | {float("inf")}


# (value, count): below the first bound, on each bound, between bounds, above the last (+Inf), no observations.
OBSERVATIONS = [(-1.0, 1), (0.0, 2), (0.01, 3), (0.05, 1), (0.1, 4), (1.0, 2), (7.5, 5), (0.3, 0)]


def histogram_samples(registry: CollectorRegistry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in registry.collect() for s in f.samples
            if not s.name.endswith("_created")}  # prometheus_client's creation time has no counterpart


def test_weighted_histogram_matches_one_observe_per_value():
    """The same samples (names, `le` labels, counts) as prometheus_client's Histogram observed one
    value at a time; the sum up to rounding (value * count versus repeated adds)."""
    expected_registry, registry = CollectorRegistry(), CollectorRegistry()
    expected = Histogram("h", "doc", ["model_name"], registry=expected_registry, buckets=(0.01, 0.1, 1.0)).labels("m")
    weighted = WeightedHistogram("h", "doc", (0.01, 0.1, 1.0), {"model_name": "m"}, registry)
    for value, count in OBSERVATIONS:
        for _ in range(count):
            expected.observe(value)
        weighted.observe(value, count)
    want, got = histogram_samples(expected_registry), histogram_samples(registry)
    assert want.keys() == got.keys()
    for key, value in got.items():
        assert value == (pytest.approx(want[key], rel=1e-12) if key[0] == "h_sum" else want[key]), key
