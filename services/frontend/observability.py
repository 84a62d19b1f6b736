"""The frontend's observability in one object: metrics always, spans when tracing is on.

Hooks elsewhere are one line each:
- `FrontendServer.start` builds a `FrontendObserver`, hangs it on the engine client
  (`engine_client.observer`) and calls `install(app, observer)` for `/metrics` and the HTTP span;
- `EngineClient._dispatch` passes each step's outputs to `observer.on_step` (token times, events);
- `OpenAIServing.generate_choices` wraps its merged delta stream in `observe_choices(...)`, which
  follows the request from its first delta to its end: the GenAI span, the engine requests'
  traceparent, and the finish of its request metrics.
With no observer (tests with a fake engine) `observe_choices` returns the stream itself.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator, TypeVar

from aiohttp import web

from services.common.metrics_server import metrics_response
from services.common.telemetry import Tracing, traceparent_of
from services.frontend.metrics import FrontendMetrics
from services.frontend.tracing import end_genai_span, http_tracing_middleware, start_genai_span

T = TypeVar("T")


class FrontendObserver:
    def __init__(self, engine_client: Any, model_name: str, tracing: Tracing | None = None):
        self.model_name = model_name
        self.tracing = tracing
        self.metrics = FrontendMetrics(model_name, engine_client)

    def on_step(self, outputs: Any) -> None:
        self.metrics.on_step(outputs)

    async def observe(self, choices: list[Any], deltas: AsyncIterator[T]) -> AsyncIterator[T]:
        """Yields `deltas` unchanged, recording the request around them (see the module docstring)."""
        span = None
        if self.tracing is not None:
            span = start_genai_span(self.tracing, self.model_name, choices)
            traceparent, tracestate = traceparent_of(span)
            for choice in choices:  # not yet sent: the engine streams start on the first read below
                choice.engine_request.traceparent = traceparent
                choice.engine_request.tracestate = tracestate
        for choice in choices:
            request = choice.engine_request
            self.metrics.track(request.request_id, len(request.prompt_token_ids), request.arrival_time)
        error: BaseException | None = None
        try:
            async with aclosing(deltas) as inner:
                async for item in inner:
                    yield item
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the consumer left (client gone, stop string, Abort): unfinished choices are aborts
        except BaseException as exc:
            error = exc
            raise
        finally:
            unfinished = "error" if error is not None else "abort"
            reasons = [choice.finish_reason or unfinished for choice in choices]
            times = [self.metrics.finish(c.engine_request.request_id, r) for c, r in zip(choices, reasons)]
            if span is not None:
                end_genai_span(span, self.model_name, choices, reasons, times[0], error)


def observe_choices(engine_client: Any, choices: list[Any], deltas: AsyncIterator[T]) -> AsyncIterator[T]:
    """The hook in `generate_choices`: `deltas` itself when nothing observes this engine client."""
    observer = getattr(engine_client, "observer", None)
    if observer is None:
        return deltas
    return observer.observe(choices, deltas)


OBSERVER_KEY = web.AppKey("observer", FrontendObserver)


def install(app: web.Application, observer: FrontendObserver) -> None:
    """GET /metrics and, when tracing, the HTTP server span (outermost, so it sees error responses)."""
    app[OBSERVER_KEY] = observer
    app.router.add_get("/metrics", metrics_handler)
    if observer.tracing is not None:
        app.middlewares.insert(0, http_tracing_middleware(observer.tracing))


async def metrics_handler(request: web.Request) -> web.Response:
    return metrics_response(request.app[OBSERVER_KEY].metrics.registry)
