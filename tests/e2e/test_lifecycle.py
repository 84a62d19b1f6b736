"""What the Kubernetes manifests rely on: graceful drain on SIGTERM and recovery from a lost worker."""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import urllib.error
import urllib.request

import openai
import pytest

from services.common.model_files import resolve_model
from tests.e2e.cluster import SpindleCluster
from tests.e2e.probes import grpc_serving, health_status, wait_until

LONG_MAX_TOKENS = 60


@pytest.fixture()
def cluster(tmp_path):
    # A request sent while no engine is ready waits 1 s for one (the worker may be paused meanwhile).
    c = SpindleCluster(tmp_path, env={"SPINDLE_MAX_MODEL_LEN": "2048", "SPINDLE_SHUTDOWN_TIMEOUT": "60",
                                      "SPINDLE_ENGINE_WAIT_TIMEOUT": "1"})
    try:
        yield c.start()
    finally:
        c.stop()


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _start_long_stream(cluster, results: dict) -> tuple[threading.Event, threading.Event]:
    """Streams a long request in a thread; returns events set once its first chunk arrived and once
    it ended (with "text" or "error" in `results`)."""
    first_chunk, done = threading.Event(), threading.Event()

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
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return first_chunk, done


def _assert_new_requests_refused(cluster) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        _client(cluster).chat.completions.create(model=resolve_model(None, None).name,
                                                 messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 503


def _stats(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=5) as resp:
        return json.load(resp)


@contextlib.contextmanager
def _worker_paused(cluster):
    """Stops the worker process (SIGSTOP) so no step completes: a running request stays in flight, for
    as long as the block lasts, however fast or slow the machine. The scheduler's event loop is not
    blocked by it, so its health, stats and refusals still answer. Keep the block short: the
    scheduler's gRPC keepalive (10 s, then 5 s for the answer) would end the stream to a worker that
    stays stopped."""
    worker = cluster.procs["worker"]
    worker.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.send_signal(signal.SIGCONT)


def test_frontend_sigterm_drains_in_flight_and_refuses_new(cluster):
    results: dict = {}
    first_chunk, done = _start_long_stream(cluster, results)
    assert first_chunk.wait(120) and "error" not in results, results
    with _worker_paused(cluster):
        # Paused once the first token is out: the stream cannot end before the worker resumes.
        assert _stats(cluster)["num_running_reqs"] == 1
        cluster.procs["frontend"].send_signal(signal.SIGTERM)
        wait_until(lambda: health_status(cluster) == 503, "/health did not turn 503 on SIGTERM")
        wait_until(lambda: not grpc_serving(cluster.frontend_grpc_addr), "gRPC health stayed SERVING")
        _assert_new_requests_refused(cluster)
        # The refusals came while the stream was still in flight, not after it ended.
        assert not done.is_set() and _stats(cluster)["num_running_reqs"] == 1
    assert done.wait(120), "the in-flight request hung"
    assert "error" not in results, results
    assert results["finish_reason"] == "length" and results["completion_tokens"] == LONG_MAX_TOKENS
    assert cluster.procs["frontend"].wait(30) == 0


def test_scheduler_sigterm_drains_in_flight_and_refuses_new(cluster):
    results: dict = {}
    first_chunk, done = _start_long_stream(cluster, results)
    assert first_chunk.wait(120) and "error" not in results, results
    with _worker_paused(cluster):
        assert _stats(cluster)["num_running_reqs"] == 1
        cluster.procs["scheduler"].send_signal(signal.SIGTERM)
        wait_until(lambda: not grpc_serving(cluster.scheduler_addr), "scheduler gRPC health stayed SERVING")
        _assert_new_requests_refused(cluster)
        assert not done.is_set() and _stats(cluster)["num_running_reqs"] == 1
    assert done.wait(120), "the in-flight request hung"
    assert "error" not in results, results
    assert results["finish_reason"] == "length" and results["completion_tokens"] == LONG_MAX_TOKENS
    assert cluster.procs["scheduler"].wait(30) == 0


def test_lost_worker_fails_requests_clearly_and_the_engine_recovers(cluster):
    results: dict = {}
    first_chunk, done = _start_long_stream(cluster, results)
    assert first_chunk.wait(120) and "error" not in results, results
    cluster.procs["worker"].kill()
    assert done.wait(30), "a request on a dead worker hung"
    assert "error" in results, "a request on a dead worker must fail, not complete"
    assert "worker" in str(results["error"]).lower()
    wait_until(lambda: health_status(cluster) == 503, "health did not turn NOT_SERVING", timeout_s=10)
    _assert_new_requests_refused(cluster)

    cluster.start_service("worker")
    cluster.wait_healthy(timeout_s=120)
    resp = _client(cluster).chat.completions.create(
        model=resolve_model(None, None).name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0)
    assert resp.choices[0].message.content == "The capital of France is Paris."
    # A worker lost while the engine is idle is noticed too, before a request finds out.
    cluster.procs["worker"].kill()
    wait_until(lambda: health_status(cluster) == 503, "an idle engine did not notice its worker died",
                timeout_s=10)
    assert not grpc_serving(cluster.scheduler_addr)
