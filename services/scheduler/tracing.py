"""The scheduler's spans: one `scheduler.request` per traced request, with `scheduler.queue`,
`scheduler.prefill` and `scheduler.decode` children.

A request is traced when the frontend sent a W3C traceparent with it (EngineCoreRequest.traceparent):
the frontend makes the sampling decision, so the scheduler never starts orphan traces. The request
span is a child of the frontend's GenAI span; its own traceparent replaces the request's, so the
worker's span for the request (sent in NewRequestData) becomes its child.

Phases are built from what the engine core publishes anyway: the request's events (QUEUED,
SCHEDULED, PREEMPTED, with scheduler timestamps) and the time of the step whose outputs carry its
first and last tokens. Child spans are created when their phase ends, with explicit start and end
times, so `schedule()` and `update_from_output()` are untouched: the busy loop pays one dictionary
look-up per published output. Preemptions and resumptions are events on the request span.
"""
from __future__ import annotations

import time
from typing import Any

from services.common.messages import EngineCoreOutputs, FinishReason, OutputExtras, RequestEventType
from services.common.telemetry import Tracing, context_from_traceparent, seconds_to_ns, traceparent_of
from services.scheduler.request import Request


class _RequestTrace:
    __slots__ = ("span", "queued_s", "scheduled_s", "first_token_s", "num_output_tokens", "num_preemptions")

    def __init__(self, span: Any, queued_s: float):
        self.span = span
        self.queued_s = queued_s
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.num_output_tokens = 0
        self.num_preemptions = 0


class SchedulerTracer:
    def __init__(self, tracing: Tracing):
        from opentelemetry import trace  # only imported when tracing is on

        self._trace = trace
        self.tracer = tracing.tracer
        self._requests: dict[str, _RequestTrace] = {}

    def on_add(self, request: Request) -> None:
        """Starts the request's span (if the frontend traces it) and makes it the worker's parent."""
        if not request.traceparent or request.request_id in self._requests:
            return  # untraced, or a duplicate id the scheduler is about to reject
        now = time.time()
        span = self.tracer.start_span(
            "scheduler.request",
            context=context_from_traceparent(request.traceparent),
            start_time=seconds_to_ns(now),
            attributes={"spindle.request_id": request.request_id,
                        "spindle.num_prompt_tokens": request.num_prompt_tokens,
                        "spindle.priority": request.priority},
        )
        if not span.is_recording():  # the frontend's sampler said no: keep its context for the worker
            return
        request.traceparent, _ = traceparent_of(span)
        self._requests[request.request_id] = _RequestTrace(span, now)

    def on_outputs(self, step: EngineCoreOutputs) -> None:
        """Advances the phases of traced requests; `now` is the step's publication time."""
        if not self._requests:
            return
        now = time.time()
        extras_of = step.extras.get
        for req_id, token_ids in zip(step.req_ids, step.new_token_ids):
            trace = self._requests.get(req_id)
            if trace is None:
                continue
            extras = extras_of(req_id)
            if extras is not None:
                for event in extras.events:
                    self._on_event(trace, event.type, event.timestamp)
            if token_ids:
                self._on_tokens(trace, len(token_ids), now)
            if extras is not None and extras.finished:
                self._finish(req_id, extras.finish_reason, now, extras)

    def _on_tokens(self, trace: _RequestTrace, num_tokens: int, now: float) -> None:
        if trace.first_token_s is None:
            trace.first_token_s = now
            self._phase(trace, "scheduler.prefill", trace.scheduled_s or trace.queued_s, now)
        trace.num_output_tokens += num_tokens

    def on_aborted(self, request_ids: list[str]) -> None:
        """Requests aborted by their frontend (client gone, stop string) publish no output."""
        now = time.time()
        for request_id in request_ids:
            if request_id in self._requests:
                self._finish(request_id, FinishReason.ABORT, now, None)

    @property
    def num_open_spans(self) -> int:
        return len(self._requests)

    # --- helpers -----------------------------------------------------------------------------------------
    def _on_event(self, trace: _RequestTrace, event_type: RequestEventType, timestamp: float) -> None:
        if event_type == RequestEventType.QUEUED:
            trace.queued_s = timestamp
        elif event_type == RequestEventType.SCHEDULED:
            if trace.scheduled_s is None:
                trace.scheduled_s = timestamp
                self._phase(trace, "scheduler.queue", trace.queued_s, timestamp)
            else:
                trace.span.add_event("resumed", timestamp=seconds_to_ns(timestamp))
        elif event_type == RequestEventType.PREEMPTED:
            trace.num_preemptions += 1
            trace.span.add_event("preempted", timestamp=seconds_to_ns(timestamp))

    def _phase(self, trace: _RequestTrace, name: str, start_s: float, end_s: float) -> None:
        span = self.tracer.start_span(name, context=self._trace.set_span_in_context(trace.span),
                                      start_time=seconds_to_ns(start_s))
        span.end(end_time=seconds_to_ns(max(start_s, end_s)))

    def _finish(self, request_id: str, reason: FinishReason, now: float, output: OutputExtras | None) -> None:
        trace = self._requests.pop(request_id)
        if trace.first_token_s is not None and trace.num_output_tokens > 1:
            self._phase(trace, "scheduler.decode", trace.first_token_s, now)
        span = trace.span
        span.set_attribute("spindle.finish_reason", reason.name.lower())
        span.set_attribute("spindle.num_output_tokens", trace.num_output_tokens)
        span.set_attribute("spindle.num_preemptions", trace.num_preemptions)
        if output is not None:
            span.set_attribute("spindle.num_cached_tokens", output.num_cached_tokens)
        if reason == FinishReason.ERROR:
            from opentelemetry.trace import Status, StatusCode

            message = output.error_message if output is not None else ""
            span.set_status(Status(StatusCode.ERROR, message))
            span.set_attribute("error.type", (output.error_code if output is not None else "") or "internal")
        span.end(end_time=seconds_to_ns(now))
