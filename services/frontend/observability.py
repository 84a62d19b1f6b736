"""The frontend's observability in one object: metrics always, spans when tracing is on.

Hooks elsewhere are one line each:
- `FrontendServer.start` builds a `FrontendObserver`, gives it to the engine client as its step
  observer, to the serving objects, and calls `install(app, observer)` for `/metrics` and the HTTP span;
- `EngineClient._dispatch` passes each step's outputs to `observer.on_step` (token times, events);
- `OpenAIServing.generate_choices` calls `observer.begin(choices)` before the engine requests are
  sent (the GenAI span, whose trace context the serving code puts on the engine requests, and the
  request metrics) and `RequestObservation.end(error)` when the request is over.
Without an observer (tests with a fake engine) nothing is recorded.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from services.common.messages import EngineCoreOutputs
from services.common.metrics_server import metrics_response
from services.common.telemetry import Tracing, traceparent_of
from services.frontend.engine_protocol import EngineClientProtocol
from services.frontend.metrics import FrontendMetrics
from services.frontend.tracing import end_genai_span, http_tracing_middleware, start_genai_span


class RequestObservation:
    """One request's span (when tracing) and its choices' metrics, from `begin` to `end`."""

    def __init__(self, observer: FrontendObserver, choices: list[Any], span: Any):
        self._observer = observer
        self._choices = choices
        self._span = span
        self.trace_context: tuple[str, str] = traceparent_of(span) if span is not None else ("", "")

    def end(self, error: BaseException | None) -> None:
        """Records how each choice ended: its finish reason, else "error" when `error` ended the
        request, else "abort" (the consumer left: client gone, stop string, Abort)."""
        unfinished = "error" if error is not None else "abort"
        reasons = [choice.finish_reason or unfinished for choice in self._choices]
        metrics = self._observer.metrics
        times = [metrics.finish(c.engine_request.request_id, r) for c, r in zip(self._choices, reasons)]
        if self._span is not None:
            end_genai_span(self._span, self._observer.model_name, self._choices, reasons, times[0], error)


class FrontendObserver:
    def __init__(self, engine_client: EngineClientProtocol, model_name: str, tracing: Tracing | None = None):
        self.model_name = model_name
        self.tracing = tracing
        self.metrics = FrontendMetrics(model_name, engine_client)

    def on_step(self, outputs: EngineCoreOutputs) -> None:
        self.metrics.on_step(outputs)

    def begin(self, choices: list[Any]) -> RequestObservation:
        """Starts following a request's choices; `end` must follow."""
        span = start_genai_span(self.tracing, self.model_name, choices) if self.tracing is not None else None
        for choice in choices:
            request = choice.engine_request
            self.metrics.track(request.request_id, len(request.prompt_token_ids), request.arrival_time)
        return RequestObservation(self, choices, span)


OBSERVER_KEY = web.AppKey("observer", FrontendObserver)


def install(app: web.Application, observer: FrontendObserver) -> None:
    """GET /metrics and, when tracing, the HTTP server span (outermost, so it sees error responses)."""
    app[OBSERVER_KEY] = observer
    app.router.add_get("/metrics", metrics_handler)
    if observer.tracing is not None:
        app.middlewares.insert(0, http_tracing_middleware(observer.tracing))


async def metrics_handler(request: web.Request) -> web.Response:
    return metrics_response(request.app[OBSERVER_KEY].metrics.registry)
