"""The frontend's Prometheus metrics: per-request latencies and token counts, plus the engine's state.

The frontend sees every token arrive, so the request-level series live here, measured as vLLM's
output processor measures them:
- time to first token, inter-token latency and end-to-end latency on the frontend's clock, from the
  request's arrival (EngineCoreRequest.arrival_time) to the step that delivered the token;
- queue, prefill, decode and inference time on the scheduler's clock, from the request's events
  (QUEUED, first SCHEDULED) and the timestamps of the steps carrying its first and last token.
Token counters move as tokens arrive (engine work, even for requests aborted later); latency
histograms and `request_success_total{finished_reason}` are recorded when a request ends.

The engine's gauges (running, waiting, KV cache usage: the Model Server Protocol's three) and
cumulative counters (prefix cache, preemptions) come from the latest SchedulerStats the engine
client holds, read at scrape time (services/common/metrics.py).
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.messages import EngineCoreOutputs, RequestEventType, SchedulerStats
from services.frontend.engine_protocol import EngineClientProtocol
from services.common.metrics import (
    DURATION_BUCKETS_S,
    PREFIX,
    TOKEN_BUCKETS,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    EngineStatsCollector,
    WeightedHistogram,
)

# How a request ended, as `finished_reason` labels: OpenAI's two, plus requests that never finished.
FINISHED_REASONS = ("stop", "length", "abort", "error")


class RequestTimes:
    """What one engine request's metrics need, filled in as its outputs arrive."""

    __slots__ = ("num_prompt_tokens", "arrival_s", "first_token_s", "last_token_s", "num_generation_tokens",
                 "queued_s", "scheduled_s", "first_token_engine_s", "last_token_engine_s")

    def __init__(self, num_prompt_tokens: int, arrival_s: float):
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_s = arrival_s  # frontend clock, as all *_s below but the engine ones
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_generation_tokens = 0
        self.queued_s: float | None = None  # scheduler clock
        self.scheduled_s: float | None = None
        self.first_token_engine_s: float | None = None
        self.last_token_engine_s: float | None = None

    @property
    def time_to_first_token_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_time_s(self) -> float | None:
        if self.queued_s is None or self.scheduled_s is None:
            return None
        return self.scheduled_s - self.queued_s

    @property
    def prefill_time_s(self) -> float | None:
        if self.scheduled_s is None or self.first_token_engine_s is None:
            return None
        return self.first_token_engine_s - self.scheduled_s

    @property
    def decode_time_s(self) -> float | None:
        if self.first_token_engine_s is None or self.last_token_engine_s is None:
            return None
        return self.last_token_engine_s - self.first_token_engine_s


class FrontendMetrics:
    def __init__(self, model_name: str, engine_client: EngineClientProtocol):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._inflight: dict[str, RequestTimes] = {}

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS_S)
        self.itl = WeightedHistogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.",
                                     TPOT_BUCKETS_S, {"model_name": model_name}, self.registry)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TPOT_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", DURATION_BUCKETS_S)
        self.queue = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                               DURATION_BUCKETS_S)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                 DURATION_BUCKETS_S)
        self.decode = histogram("request_decode_time_seconds", "First token to last token.", DURATION_BUCKETS_S)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                   DURATION_BUCKETS_S)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                                   TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(PREFIX + "request_success", "Requests ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.success = {reason: self._success.labels(model_name, reason) for reason in FINISHED_REASONS}

        def read_engine_stats() -> tuple[SchedulerStats, str] | None:
            if engine_client.info is None:
                return None  # never connected: no engine state to report
            return engine_client.last_stats, model_name

        self.registry.register(EngineStatsCollector(read_engine_stats))

    # --- request lifecycle ---------------------------------------------------------------------------
    def track(self, request_id: str, num_prompt_tokens: int, arrival_s: float) -> RequestTimes:
        """Starts following an engine request; `finish` must follow."""
        times = self._inflight[request_id] = RequestTimes(num_prompt_tokens, arrival_s)
        return times

    def on_step(self, outputs: EngineCoreOutputs) -> None:
        """Called by the engine client for every step's outputs, before they reach the requests."""
        if not self._inflight:
            return
        now = time.time()
        step_s = outputs.timestamp or now
        num_prompt_tokens = num_generation_tokens = 0  # counters move once per step, not per request
        # Inter-token latencies of one step mostly share one value (same previous step): observed per value.
        itl_counts: dict[float, int] = {}
        inflight = self._inflight
        for request_id, extras in outputs.extras.items():
            times = inflight.get(request_id)
            if times is None:
                continue
            for event in extras.events:
                if event.type == RequestEventType.QUEUED:
                    times.queued_s = event.timestamp
                elif event.type == RequestEventType.SCHEDULED and times.scheduled_s is None:
                    times.scheduled_s = event.timestamp
        for request_id, token_ids in zip(outputs.req_ids, outputs.new_token_ids):
            times = inflight.get(request_id)
            if times is None or not token_ids:
                continue
            num_new = len(token_ids)
            if times.first_token_s is None:
                times.first_token_s = now
                times.first_token_engine_s = step_s
                self.ttft.observe(now - times.arrival_s)
                num_prompt_tokens += times.num_prompt_tokens
            else:
                itl_s = now - times.last_token_s
                itl_counts[itl_s] = itl_counts.get(itl_s, 0) + 1
            times.last_token_s = now
            times.last_token_engine_s = step_s
            times.num_generation_tokens += num_new
            num_generation_tokens += num_new
        for itl_s, count in itl_counts.items():
            self.itl.observe(itl_s, count)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)

    def finish(self, request_id: str, finished_reason: str) -> RequestTimes | None:
        """Stops following a request; latency histograms count requests that finished (stop, length)."""
        times = self._inflight.pop(request_id, None)
        if times is None:
            return None
        self.success[finished_reason if finished_reason in self.success else "error"].inc()
        if finished_reason not in ("stop", "length"):
            return times
        now = time.time()
        self.e2e.observe((times.last_token_s or now) - times.arrival_s)
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_generation_tokens)
        if times.num_generation_tokens > 1 and times.first_token_s is not None:
            self.tpot.observe((times.last_token_s - times.first_token_s) / (times.num_generation_tokens - 1))
        for histogram, value in ((self.queue, times.queue_time_s), (self.prefill, times.prefill_time_s),
                                 (self.decode, times.decode_time_s)):
            if value is not None:
                histogram.observe(max(value, 0.0))
        if times.scheduled_s is not None and times.last_token_engine_s is not None:
            self.inference.observe(max(times.last_token_engine_s - times.scheduled_s, 0.0))
        return times

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)
