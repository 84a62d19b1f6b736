"""The worker's Prometheus metrics: what each step cost and how big it was.

Recorded once per step in the model-runner thread (prometheus_client's metrics are thread-safe);
served from the worker's event loop on --metrics-port. The model name label is bound once the model
is loaded (no step can run before that).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.messages import ModelRunnerOutput, SchedulerOutput
from services.common.metrics import DURATION_BUCKETS_S, PREFIX

# Tokens per step: from single-token decode steps up to a full token budget.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A step of a small model takes milliseconds: the request-duration buckets start too high for it.
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005) + DURATION_BUCKETS_S


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._step_time = Histogram(PREFIX + "worker_step_time_seconds",
                                    "Time of one ExecuteModel step in the worker (prepare, forward, sample).",
                                    labels, registry=self.registry, buckets=STEP_BUCKETS_S)
        self._forward_time = Histogram(PREFIX + "worker_forward_time_seconds", "Model forward time of one step.",
                                       labels, registry=self.registry, buckets=STEP_BUCKETS_S)
        self._iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "Tokens computed in one step.",
                                           labels, registry=self.registry, buckets=ITERATION_TOKEN_BUCKETS)
        self._steps = Counter(PREFIX + "worker_steps", "Steps executed.", labels, registry=self.registry)
        self._failed_steps = Counter(PREFIX + "worker_failed_steps", "Steps that raised (their requests failed).",
                                     labels, registry=self.registry)
        self._bound: tuple | None = None

    def set_model_name(self, model_name: str) -> None:
        self._bound = (self._step_time.labels(model_name), self._forward_time.labels(model_name),
                       self._iteration_tokens.labels(model_name), self._steps.labels(model_name),
                       self._failed_steps.labels(model_name))

    def on_step(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        if self._bound is None or scheduler_output.total_num_scheduled_tokens == 0:
            return  # empty steps only tell the worker which requests finished
        step_time, forward_time, iteration_tokens, steps, _ = self._bound
        step_time.observe((output.prepare_ns + output.forward_ns + output.sample_ns) / 1e9)
        forward_time.observe(output.forward_ns / 1e9)
        iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)
        steps.inc()

    def on_step_failed(self) -> None:
        if self._bound is not None:
            self._bound[4].inc()
