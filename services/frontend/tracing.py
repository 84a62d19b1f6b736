"""The frontend's spans: the HTTP server span, and one GenAI span per chat or completion request.

- HTTP: a SERVER span `{method} {route}` per request, child of the caller's W3C `traceparent` header
  when there is one (gRPC calls get theirs from opentelemetry-instrumentation-grpc instead). Probes
  and scrapes (/health, /metrics) are not traced.
- GenAI: `chat {model}` or `text_completion {model}`, a child of the server span, with the GenAI
  semantic conventions' request, response and usage attributes. Its context goes into every
  EngineCoreRequest (traceparent/tracestate), which is how the scheduler's and worker's spans join
  the trace: the frontend-to-scheduler link is one long-lived stream, so gRPC metadata cannot carry
  a per-request context there.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from aiohttp import web

from services.common.telemetry import Tracing
from services.frontend.metrics import RequestTimes

PROVIDER_NAME = "spindle"
UNTRACED_PATHS = frozenset({"/health", "/metrics", "/version"})


def http_tracing_middleware(tracing: Tracing) -> Callable:
    """aiohttp middleware: the SERVER span of each request; put it outside the error middleware so
    it records the status the client really gets."""
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    tracer = tracing.tracer

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path in UNTRACED_PATHS:
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        parent = propagator.extract({k.lower(): v for k, v in request.headers.items()})
        with tracer.start_as_current_span(
            f"{request.method} {route}", context=parent, kind=SpanKind.SERVER, record_exception=False,
            attributes={"http.request.method": request.method, "http.route": route, "url.path": request.path,
                        "url.scheme": request.scheme},
        ) as span:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                _set_http_status(span, exc.status, Status, StatusCode)
                raise
            _set_http_status(span, response.status, Status, StatusCode)
            return response

    return middleware


def _set_http_status(span: Any, status: int, status_cls: Any, status_code: Any) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(status_cls(status_code.ERROR))


def operation_name(request_id: str) -> str:
    """Chat requests carry chatcmpl- ids; completions (HTTP cmpl-, gRPC gen-) are text completions."""
    return "chat" if request_id.startswith("chatcmpl-") else "text_completion"


def response_id(choices: list[Any]) -> str:
    """The id the client sees: n > 1 choices run as engine requests `<id>-<i>`."""
    request_id = choices[0].engine_request.request_id
    return request_id.rsplit("-", 1)[0] if len(choices) > 1 else request_id


def start_genai_span(tracing: Tracing, model_name: str, choices: list[Any]) -> Any:
    """Starts `{operation} {model}` under the current span (the HTTP or gRPC server span)."""
    params = choices[0].engine_request.sampling_params
    operation = operation_name(choices[0].engine_request.request_id)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": model_name,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.response.id": response_id(choices),
    }
    if params.top_k > 0:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if len(choices) > 1:
        attributes["gen_ai.request.choice.count"] = len(choices)
    return tracing.tracer.start_span(f"{operation} {model_name}", attributes=attributes)


def end_genai_span(span: Any, model_name: str, choices: list[Any], finish_reasons: list[str],
                   first: RequestTimes | None, error: BaseException | None) -> None:
    """Response and usage attributes (the same numbers as the response's `usage`), then ends the span."""
    span.set_attribute("gen_ai.response.model", model_name)
    span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
    span.set_attribute("gen_ai.usage.input_tokens", len(choices[0].engine_request.prompt_token_ids))
    span.set_attribute("gen_ai.usage.output_tokens", sum(c.num_output_tokens for c in choices))
    span.set_attribute("gen_ai.usage.cache_read.input_tokens", min(c.num_cached_tokens for c in choices))
    if first is not None:  # the first choice's phases, as the scheduler measured them
        for name, value in (("time_to_first_token", first.time_to_first_token_s),
                            ("time_in_queue", first.queue_time_s), ("prefill", first.prefill_time_s),
                            ("decode", first.decode_time_s)):
            if value is not None:
                span.set_attribute(f"spindle.latency.{name}", value)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("error.type", getattr(error, "code", "") or type(error).__name__)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()
