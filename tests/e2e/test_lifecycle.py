"""What the Kubernetes manifests rely on: graceful drain on SIGTERM and recovery from a lost worker."""
from __future__ import annotations

import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.model_files import resolve_model
from tests.e2e.cluster import SpindleCluster

LONG_MAX_TOKENS = 60


@pytest.fixture()
def cluster(tmp_path):
    c = SpindleCluster(tmp_path, env={"SPINDLE_MAX_MODEL_LEN": "2048", "SPINDLE_SHUTDOWN_TIMEOUT": "60"})
    try:
        yield c.start()
    finally:
        c.stop()


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _health_status(cluster) -> int:
    try:
        with urllib.request.urlopen(cluster.base_url + "/health", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _grpc_serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _start_long_stream(cluster, results: dict) -> threading.Event:
    """Streams a long request in a thread; the event is set once its first chunk arrived."""
    first_chunk = threading.Event()

    def run():
        try:
            stream = _client(cluster).chat.completions.create(
                model=resolve_model(None, None).name, messages=[{"role": "user", "content": "Tell me a story."}],
                max_tokens=LONG_MAX_TOKENS, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            text = []
            for chunk in stream:
                first_chunk.set()
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    results["finish_reason"] = chunk.choices[0].finish_reason or results.get("finish_reason")
                if chunk.usage:
                    results["completion_tokens"] = chunk.usage.completion_tokens
            results["text"] = "".join(text)
        except Exception as exc:  # recorded for the test to assert on
            results["error"] = exc
        finally:
            first_chunk.set()

    threading.Thread(target=run, daemon=True).start()
    return first_chunk


def _assert_new_requests_refused(cluster) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        _client(cluster).chat.completions.create(model=resolve_model(None, None).name,
                                                 messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 503


def _wait_done(results: dict, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while "text" not in results and "error" not in results:
        assert time.monotonic() < deadline, "the in-flight request hung"
        time.sleep(0.1)


def test_frontend_sigterm_drains_in_flight_and_refuses_new(cluster):
    results: dict = {}
    assert _start_long_stream(cluster, results).wait(120)
    cluster.procs["frontend"].send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert _health_status(cluster) == 503
    assert not _grpc_serving(cluster.frontend_grpc_addr)
    _assert_new_requests_refused(cluster)
    _wait_done(results)
    assert "error" not in results, results
    assert results["finish_reason"] == "length" and results["completion_tokens"] == LONG_MAX_TOKENS
    assert cluster.procs["frontend"].wait(30) == 0


def test_scheduler_sigterm_drains_in_flight_and_refuses_new(cluster):
    results: dict = {}
    assert _start_long_stream(cluster, results).wait(120)
    cluster.procs["scheduler"].send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert not _grpc_serving(cluster.scheduler_addr)
    _assert_new_requests_refused(cluster)
    _wait_done(results)
    assert "error" not in results, results
    assert results["completion_tokens"] == LONG_MAX_TOKENS
    assert cluster.procs["scheduler"].wait(30) == 0


def test_lost_worker_fails_requests_clearly_and_the_engine_recovers(cluster):
    results: dict = {}
    assert _start_long_stream(cluster, results).wait(120)
    cluster.procs["worker"].kill()
    _wait_done(results, timeout_s=30)
    assert "error" in results, "a request on a dead worker must fail, not complete"
    assert "worker" in str(results["error"]).lower()
    deadline = time.monotonic() + 10
    while _health_status(cluster) != 503:
        assert time.monotonic() < deadline, "health did not turn NOT_SERVING"
        time.sleep(0.2)
    _assert_new_requests_refused(cluster)

    cluster.start_service("worker")
    cluster.wait_healthy(timeout_s=120)
    resp = _client(cluster).chat.completions.create(
        model=resolve_model(None, None).name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0)
    assert resp.choices[0].message.content == "The capital of France is Paris."
    # A worker lost while the engine is idle is noticed too, before a request finds out.
    cluster.procs["worker"].kill()
    deadline = time.monotonic() + 10
    while _health_status(cluster) != 503:
        assert time.monotonic() < deadline, "an idle engine did not notice its worker died"
        time.sleep(0.2)
    assert not _grpc_serving(cluster.scheduler_addr)
