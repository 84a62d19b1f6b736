"""The worker's spans: one `worker.execute` span per traced request, with per-step detail as events.

Why per-request spans and not a span per step with links: a step serves many requests, and a step
span can have only one parent, so it would live in a trace of its own (thousands of one-span traces
a minute), reachable from a request only by following links that trace UIs show but do not join.
A span per request, child of the scheduler's request span (its traceparent arrives once, in
NewRequestData), keeps the worker's share of the work inside the caller's trace. It covers the
request's time in the worker, from its first step to its last; each prefill chunk is an event
(step id, tokens, batch size, step time), preemptions are events, and decode steps, which are
many and alike, are summed into attributes (steps, tokens, time in steps) rather than one event
each, so the cost per step stays one dictionary look-up per scheduled request.

Used from the model-runner thread only (WorkerServicer._step), so it needs no locks.
"""
from __future__ import annotations

from typing import Any

from services.common.messages import ModelRunnerOutput, SchedulerOutput
from services.common.telemetry import Tracing, context_from_traceparent, seconds_to_ns


class _RequestSpan:
    __slots__ = ("span", "num_steps", "num_tokens", "step_time_s", "last_end_s")

    def __init__(self, span: Any, start_s: float):
        self.span = span
        self.num_steps = 0
        self.num_tokens = 0
        self.step_time_s = 0.0  # time of the steps it took part in (shared with the rest of each batch)
        self.last_end_s = start_s


class WorkerTracer:
    def __init__(self, tracing: Tracing):
        self.tracer = tracing.tracer
        self._requests: dict[str, _RequestSpan] = {}

    @property
    def num_open_spans(self) -> int:
        return len(self._requests)

    def on_step(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput, start_s: float, end_s: float) -> None:
        """Ends spans of finished requests, starts spans of new traced ones, records this step."""
        for req_id in scheduler_output.finished_req_ids:
            if req_id in self._requests:
                self._end(req_id, "finished")
        for req_id in scheduler_output.preempted_req_ids:
            if req_id in self._requests:
                self._requests[req_id].span.add_event("preempted", timestamp=seconds_to_ns(start_s))
        for new in scheduler_output.scheduled_new_reqs:
            if new.traceparent and new.req_id not in self._requests:
                self._start(new.req_id, new.traceparent, start_s, len(new.prompt_token_ids))
        if not self._requests:
            return
        step_s = end_s - start_s
        batch_size = len(scheduler_output.num_scheduled_tokens)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            request.num_steps += 1
            request.num_tokens += num_tokens
            request.step_time_s += step_s
            request.last_end_s = end_s
            if num_tokens > 1:
                request.span.add_event("prefill_chunk", timestamp=seconds_to_ns(start_s), attributes={
                    "spindle.step_id": scheduler_output.step_id,
                    "spindle.num_tokens": num_tokens,
                    "spindle.batch_size": batch_size,
                    "spindle.batch_num_tokens": scheduler_output.total_num_scheduled_tokens,
                    "spindle.step_time_s": step_s,
                    "spindle.forward_time_s": output.forward_ns / 1e9,
                })

    def reset(self) -> None:
        """A new scheduler connection dropped every request (InitializeKVCache): close their spans."""
        for req_id in list(self._requests):
            self._end(req_id, "dropped")

    def _start(self, req_id: str, traceparent: str, start_s: float, num_prompt_tokens: int) -> None:
        span = self.tracer.start_span(
            "worker.execute",
            context=context_from_traceparent(traceparent),
            start_time=seconds_to_ns(start_s),
            attributes={"spindle.request_id": req_id, "spindle.num_prompt_tokens": num_prompt_tokens},
        )
        if span.is_recording():
            self._requests[req_id] = _RequestSpan(span, start_s)

    def _end(self, req_id: str, how: str) -> None:
        request = self._requests.pop(req_id)
        span = request.span
        span.set_attribute("spindle.worker.end", how)
        span.set_attribute("spindle.worker.num_steps", request.num_steps)
        span.set_attribute("spindle.worker.num_computed_tokens", request.num_tokens)
        span.set_attribute("spindle.worker.step_time_s", request.step_time_s)
        span.end(end_time=seconds_to_ns(request.last_end_s))
