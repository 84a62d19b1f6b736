"""With no endpoint configured nothing runs: no provider, no exporter thread, no span work on the
request path; and the flags that turn telemetry on and off parse as the manifests expect."""
from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import ClientSession

from services.common.metrics_server import MetricsServer
from services.common.telemetry import client_interceptors, server_interceptors, setup_tracing, traces_endpoint
from services.frontend.config import FrontendConfig
from services.frontend.observability import FrontendObserver
from services.frontend.server import FrontendServer
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model
from tests.k8s.service_flags import flag_defaults, parse_config

OTEL_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
                  "OTEL_TRACES_EXPORTER", "SPINDLE_OTLP_TRACES_ENDPOINT")


@pytest.fixture
def no_otel_env(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def otel_threads() -> set[threading.Thread]:
    """OpenTelemetry's exporter threads (OtelBatchSpanRecordProcessor ...) alive now."""
    return {t for t in threading.enumerate() if "otel" in t.name.lower()}


def test_endpoint_comes_from_the_flag_or_the_standard_variables():
    assert traces_endpoint(None, {}) is None
    assert traces_endpoint("", {}) is None
    assert traces_endpoint("collector:4317", {}) == "http://collector:4317"  # a bare host is plain gRPC
    assert traces_endpoint("https://c:4317", {}) == "https://c:4317"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}) == "http://a:4317"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317",
                                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}) == "http://t:4317"
    assert traces_endpoint("http://flag:1", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}) == "http://flag:1"
    # The standard switches win over any endpoint.
    assert traces_endpoint("http://flag:1", {"OTEL_SDK_DISABLED": "true"}) is None
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_TRACES_EXPORTER": "none"}) \
        is None


def test_no_endpoint_means_no_provider_no_thread_no_interceptor(no_otel_env):
    before = otel_threads()
    assert setup_tracing("spindle-scheduler", None) is None
    assert server_interceptors(None) == [] and client_interceptors(None) == []
    assert otel_threads() == before


def test_frontend_without_endpoint_does_no_span_work(no_otel_env):
    """A real FrontendServer (HTTP and gRPC) with a fake engine: no tracer, no middleware, no
    traceparent on engine requests, the delta stream not even wrapped; metrics still count."""
    engine = FakeEngineClient(make_tokenizer())

    before = otel_threads()  # other tests in this process may have left theirs

    async def scenario():
        server = FrontendServer(FrontendConfig(http_port=0, grpc_addr="127.0.0.1:0"), engine,
                                serving_model(engine.tokenizer))
        await server.start()
        try:
            assert server.tracing is None and server.observer.tracing is None
            assert engine.observer is server.observer
            async with ClientSession() as http:
                url = f"http://127.0.0.1:{server.http_port}"
                async with http.post(url + "/v1/chat/completions", json={
                        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}) as resp:
                    assert resp.status == 200, await resp.text()
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
            threads = otel_threads()
        finally:
            await server.stop()
        return text, threads

    text, threads = asyncio.run(scenario())
    assert threads == before
    assert [r.traceparent for r in engine.requests] == [""]
    assert 'spindle:request_success_total{finished_reason="stop",model_name="fake-model"} 1.0' in text


def test_without_tracing_the_engine_requests_carry_no_trace_context():
    observer = FrontendObserver(FakeEngineClient(make_tokenizer()), "fake-model", tracing=None)
    assert observer.begin([]).trace_context == ("", "")


def test_metrics_port_flags_match_the_manifests():
    assert flag_defaults("scheduler")["SPINDLE_METRICS_PORT"] == 9092
    assert flag_defaults("worker")["SPINDLE_METRICS_PORT"] == 9093
    assert "SPINDLE_METRICS_PORT" not in flag_defaults("frontend")  # the frontend serves /metrics on HTTP
    for service in ("frontend", "scheduler", "worker"):
        assert flag_defaults(service)["SPINDLE_OTLP_TRACES_ENDPOINT"] is None
    assert parse_config("scheduler", {}).telemetry.metrics_port == 9092
    assert parse_config("scheduler", {"SPINDLE_METRICS_PORT": "0"}).telemetry.metrics_port == 0
    worker = parse_config("worker", {"SPINDLE_METRICS_PORT": "9300",
                                     "SPINDLE_OTLP_TRACES_ENDPOINT": "http://c:4317"}).telemetry
    assert (worker.metrics_port, worker.otlp_traces_endpoint) == (9300, "http://c:4317")
    assert parse_config("frontend", {"SPINDLE_OTLP_TRACES_ENDPOINT": "c:4317"}).telemetry.otlp_traces_endpoint \
        == "c:4317"


def test_metrics_port_zero_listens_nowhere_and_a_busy_port_is_not_fatal():
    from prometheus_client import CollectorRegistry

    async def scenario():
        off = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
        await off.start()
        assert off._runner is None
        first = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
        first.port = _free_port()
        await first.start()
        second = MetricsServer(CollectorRegistry(), "127.0.0.1", first.port)
        await second.start()  # logs an error, keeps the service up
        assert first._runner is not None and second._runner is None
        await first.stop()

    asyncio.run(scenario())


def _free_port() -> int:
    from tests.e2e.cluster import free_port

    return free_port()
