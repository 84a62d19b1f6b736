"""Tracing set-up shared by the three services, and W3C trace context carried inside messages.

Tracing is off unless an OTLP endpoint is configured: `--otlp-traces-endpoint` (SPINDLE_OTLP_TRACES_ENDPOINT),
else the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT. Off means
`setup_tracing` returns None: no tracer provider, no exporter thread, and every hook in the services
tests `is None` once and does nothing else, so an untraced server pays one attribute check per
request or step. The SDK is imported only when tracing is on.

Spans are exported over OTLP/gRPC in batches (BatchSpanProcessor: a background thread, so a slow
collector never blocks a step). The resource names the service (`service.name` = spindle-frontend,
spindle-scheduler or spindle-worker) unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES says
otherwise, as the Kubernetes manifests do.

We keep our own TracerProvider instead of installing the global one: several services can then live
in one test process, and nothing outside Spindle's hooks starts spans by accident.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from services.common.flags import add_flag

TRACER_NAME = "spindle"

# RPCs that get a gRPC server/client span (context in metadata). The long-lived Connect and
# ExecuteModel streams carry many requests each, so a span per stream would be meaningless: request
# context rides inside EngineCoreRequest and NewRequestData instead. Health, reflection and the
# polled GetStats are left out as noise.
TRACED_RPCS = frozenset({
    "/spindle.v1.GenerateService/Generate",
    "/spindle.v1.GenerateService/Tokenize",
    "/spindle.v1.GenerateService/GetModelInfo",
    "/spindle.v1.GenerateService/Abort",
    "/spindle.v1.EngineCoreService/GetEngineInfo",
    "/spindle.v1.WorkerService/DescribeKVCache",
    "/spindle.v1.WorkerService/InitializeKVCache",
})


@dataclass(frozen=True)
class TelemetryConfig:
    otlp_traces_endpoint: str | None = None
    # Port of the service's own Prometheus endpoint; 0 disables it (the frontend uses its HTTP port).
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")


def add_telemetry_flags(parser: argparse.ArgumentParser, default_metrics_port: int | None = None) -> None:
    """`--otlp-traces-endpoint` for every service; `--metrics-port` for those given a default."""
    add_flag(parser, "--otlp-traces-endpoint", default=None,
             help="OTLP/gRPC endpoint for traces, e.g. http://127.0.0.1:4317 (default: OTEL_EXPORTER_OTLP_*; "
                  "unset: tracing off)")
    if default_metrics_port is not None:
        add_flag(parser, "--metrics-port", type=int, default=default_metrics_port,
                 help="port of the Prometheus /metrics endpoint (0: off)")


def telemetry_config_from_args(args: argparse.Namespace) -> TelemetryConfig:
    return TelemetryConfig(otlp_traces_endpoint=args.otlp_traces_endpoint or None,
                           metrics_port=getattr(args, "metrics_port", 0) or 0)


def traces_endpoint(flag_value: str | None, environ: Any = os.environ) -> str | None:
    """The endpoint to export to, or None for "tracing off" (OTEL_SDK_DISABLED and
    OTEL_TRACES_EXPORTER=none switch it off even when an endpoint is set)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    endpoint = (flag_value or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
    if not endpoint:
        return None
    # The exporter takes a bare host:port as a TLS endpoint; a local collector speaks plain gRPC.
    return endpoint if "://" in endpoint else f"http://{endpoint}"


class Tracing:
    """A tracer with its own provider and exporter. Services hold `Tracing | None`."""

    def __init__(self, provider: Any, service_name: str):
        self.provider = provider
        self.service_name = service_name
        self.tracer = provider.get_tracer(TRACER_NAME)

    def shutdown(self) -> None:
        """Exports what is still queued and stops the exporter thread."""
        self.provider.shutdown()


def setup_tracing(service_name: str, flag_value: str | None, exporter: Any = None) -> Tracing | None:
    """Tracing for one service, or None when no endpoint is configured.

    `exporter` replaces the OTLP exporter (tests pass an in-memory one).
    """
    endpoint = traces_endpoint(flag_value)
    if endpoint is None and exporter is None:
        return None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Our default name first; OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, when set, win.
    resource = Resource.create({"service.name": service_name}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # The exporter reads OTEL_EXPORTER_OTLP_* (headers, certificates, timeout) by itself.
        exporter = OTLPSpanExporter(endpoint=endpoint)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, str(resource.attributes.get("service.name", service_name)))


# --- W3C trace context inside messages ---------------------------------------------------------------
def context_from_traceparent(traceparent: str, tracestate: str = "") -> Any:
    """An OpenTelemetry Context whose parent is the given W3C traceparent (empty context if invalid)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def traceparent_of(span: Any) -> tuple[str, str]:
    """(traceparent, tracestate) naming `span` as the parent, for a message that crosses services."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


def seconds_to_ns(timestamp_s: float) -> int:
    """Span timestamps are integer nanoseconds since the epoch."""
    return int(timestamp_s * 1e9)


# --- gRPC: context in metadata -----------------------------------------------------------------------
def _is_traced_rpc(details: Any) -> bool:
    method = details.method
    if isinstance(method, bytes):
        method = method.decode()
    return method in TRACED_RPCS


def server_interceptors(tracing: Tracing | None) -> list[Any]:
    """The OpenTelemetry gRPC server interceptor (accepts an incoming traceparent), or none when off."""
    if tracing is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=tracing.provider, filter_=_is_traced_rpc)]


def client_interceptors(tracing: Tracing | None) -> list[Any]:
    """The OpenTelemetry gRPC client interceptors (send traceparent in metadata), or none when off."""
    if tracing is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=tracing.provider, filter_=_is_traced_rpc))
