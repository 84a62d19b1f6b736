"""A real OTLP/gRPC trace receiver in the test process (opentelemetry-proto's TraceService)."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3


def any_value(value: Any) -> Any:
    """An OTLP AnyValue as a Python value (arrays become lists)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    event_names: list[str] = field(default_factory=list)
    status_code: int = 0


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_exports = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = 0

    def start(self) -> "OtlpReceiver":
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: any_value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: any_value(a.value) for a in span.attributes},
                        event_names=[e.name for e in span.events],
                        status_code=span.status.code,
                    ))
        with self._lock:
            self.spans.extend(received)
            self.num_exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Waits until `predicate(spans)` holds; returns the spans (fails with what arrived otherwise)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.snapshot()
            if predicate(spans):
                return spans
            time.sleep(0.1)
        spans = self.snapshot()
        summary = "\n".join(f"  {s.service} {s.name} trace={s.trace_id} parent={s.parent_span_id}" for s in spans)
        raise AssertionError(f"spans did not arrive in {timeout_s} s; got {len(spans)}:\n{summary}")
