"""A scheduler killed outright (SIGKILL, as the OOM killer or a node failure would) while requests
stream: every in-flight request ends with the frontend's OpenAI error instead of hanging, readiness
reports the outage, and once a scheduler is back on the same address the frontend reconnects by
itself and the same worker process serves the same greedy tokens as before.

(A lost worker is covered by tests/e2e/test_lifecycle.py.)"""
from __future__ import annotations

import contextlib
import http.client
import json
import signal
import threading
import urllib.error
import urllib.request
from unittest import mock

import pytest

from tests.e2e.cluster import SpindleCluster
from tests.e2e.probes import grpc_serving, wait_until
from tests.e2e.test_tiny_models import build_tiny_model

# Long enough that no stream can finish on its own before the scheduler is killed.
MAX_MODEL_LEN = 4096
LONG_MAX_TOKENS = 4000
NUM_STREAMS = 3
GREEDY_MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "Name three rivers."}]
FAIL_DEADLINE_S = 30
RECONNECT_DEADLINE_S = 180

# The OpenAI error object the frontend sends for an engine lost mid-request (services/frontend/errors.py).
LOST_SCHEDULER_TYPE = "server_error"
LOST_SCHEDULER_CODE = "service_unavailable"
LOST_SCHEDULER_PREFIX = "lost the scheduler: "


@pytest.fixture()
def cluster(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", "llama")
    # The random model needs no trained positions: a longer limit only lets requests run long.
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    config_file.write_text(json.dumps(config))
    c = SpindleCluster(tmp_path, env={"SPINDLE_MODEL": str(model_dir), "SPINDLE_KV_CACHE_BYTES": "16MiB"})
    try:
        yield c.start()
    finally:
        c.stop()


def _post(cluster, body: dict) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a non-streamed chat completion."""
    request = urllib.request.Request(cluster.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.load(resp), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err), dict(err.headers)


def _get(cluster, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(cluster.base_url + path, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _body(model: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def _greedy_token_ids(cluster, model: str) -> list[int]:
    status, body, _ = _post(cluster, _body(model, GREEDY_MAX_TOKENS, return_token_ids=True))
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length", body
    return body["choices"][0]["token_ids"]


class Stream:
    """One streamed chat completion read in a thread: its HTTP status and `data:` events in order."""

    def __init__(self, cluster, body: dict):
        self.status: int | None = None
        self.events: list = []  # parsed JSON objects, and "[DONE]"
        self.error: Exception | None = None
        self.first_event = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(cluster.http_port, {**body, "stream": True}), daemon=True).start()

    def _run(self, port: int, body: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            for line in resp:
                if line.startswith(b"data: "):
                    data = line[len(b"data: "):].strip()
                    self.events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
                    self.first_event.set()
        except Exception as exc:  # recorded for the test to assert on
            self.error = exc
        finally:
            conn.close()
            self.first_event.set()
            self.done.set()


@contextlib.contextmanager
def _worker_paused(cluster):
    """No step completes while the block lasts, so the streams are provably mid-flight at the kill."""
    cluster.procs["worker"].send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        cluster.procs["worker"].send_signal(signal.SIGCONT)


def _assert_lost_scheduler_error(error: dict) -> None:
    assert set(error) == {"error"}, error
    assert set(error["error"]) == {"message", "type", "param", "code"}, error
    assert error["error"]["type"] == LOST_SCHEDULER_TYPE, error
    assert error["error"]["code"] == LOST_SCHEDULER_CODE, error
    assert error["error"]["param"] is None, error
    assert error["error"]["message"].startswith(LOST_SCHEDULER_PREFIX), error


def test_scheduler_killed_mid_stream_fails_requests_and_the_frontend_reconnects(cluster):
    model = _get(cluster, "/v1/models")[1]["data"][0]["id"]
    frontend, worker = cluster.procs["frontend"], cluster.procs["worker"]
    expected_ids = _greedy_token_ids(cluster, model)
    assert len(expected_ids) == GREEDY_MAX_TOKENS
    total_blocks = _get(cluster, "/stats")[1]["num_total_blocks"]

    streams = [Stream(cluster, _body(model, LONG_MAX_TOKENS)) for _ in range(NUM_STREAMS)]
    for stream in streams:
        assert stream.first_event.wait(120) and stream.error is None, (stream.status, stream.error)
    final_only: dict = {}
    final_only_done = threading.Event()

    def post_final_only() -> None:
        try:
            final_only["result"] = _post(cluster, _body(model, LONG_MAX_TOKENS))
        except Exception as exc:  # recorded for the test to assert on
            final_only["result"] = exc
        finally:
            final_only_done.set()

    threading.Thread(target=post_final_only, daemon=True).start()
    wait_until(lambda: _get(cluster, "/stats")[1]["num_running_reqs"] == NUM_STREAMS + 1,
                "the non-streamed request did not start running", timeout_s=60)

    with _worker_paused(cluster):
        assert not any(s.done.is_set() for s in streams) and not final_only_done.is_set()
        cluster.procs["scheduler"].kill()
        assert cluster.procs["scheduler"].wait(30) == -signal.SIGKILL

    # Each stream ends (never hangs) with one error event, then [DONE], and no finish_reason.
    for i, stream in enumerate(streams):
        assert stream.done.wait(FAIL_DEADLINE_S), f"stream {i} hung after the scheduler died"
        assert stream.error is None and stream.status == 200, (stream.status, stream.error)
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        _assert_lost_scheduler_error(stream.events[-2])
        chunks = stream.events[:-2]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, chunks[0]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks), chunks[-1]
    # A request whose response had not begun gets the same error as a plain HTTP 503.
    assert final_only_done.wait(FAIL_DEADLINE_S), "the non-streamed request hung after the scheduler died"
    assert isinstance(final_only["result"], tuple), final_only["result"]
    status, body, headers = final_only["result"]
    assert status == 503 and headers["Retry-After"] == "5", (status, headers)
    _assert_lost_scheduler_error(body)

    # While the scheduler is gone: not ready, refusals, and the worker keeps running untouched.
    assert _get(cluster, "/health") == (503, {"status": "engine not ready"})
    status, body = _get(cluster, "/stats")
    assert status == 503 and body["error"]["code"] == "service_unavailable", body
    assert body["error"]["message"].startswith("cannot reach the scheduler"), body
    status, body, _ = _post(cluster, _body(model, 2))
    assert (status, body["error"]["code"]) == (503, "service_unavailable"), body
    assert body["error"]["message"] == "The engine is not ready; try again shortly.", body
    assert worker.poll() is None and grpc_serving(cluster.worker_addr)

    cluster.start_service("scheduler")
    cluster.wait_healthy(timeout_s=RECONNECT_DEADLINE_S)  # the frontend reconnected by itself

    assert cluster.procs["frontend"] is frontend and frontend.poll() is None
    assert cluster.procs["worker"] is worker and worker.poll() is None
    # The worker loaded its model once: it was reused, not restarted behind the test's back.
    assert cluster.log_tail("worker", 10**9).count("worker ready on") == 1
    assert _greedy_token_ids(cluster, model) == expected_ids
    after = Stream(cluster, _body(model, 8))
    assert after.done.wait(120) and after.error is None and after.status == 200, (after.status, after.error)
    assert after.events[-1] == "[DONE]" and after.events[-2]["choices"][0]["finish_reason"] == "length", \
        after.events[-3:]
    stats = cluster.wait_for_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == total_blocks, stats


def test_frontend_caps_grpc_reconnect_backoff_at_its_own_retry_cap(monkeypatch):
    """gRPC's default reconnect back-off grows to 120 s: after a 4-minute scheduler outage the frontend
    stayed unready for 79 s once the scheduler was back. Its channel must cap it at the client's cap."""
    from services.frontend import engine_client

    factory = mock.Mock(return_value=mock.MagicMock())
    monkeypatch.setattr(engine_client.grpc.aio, "insecure_channel", factory)
    engine_client.EngineClient("127.0.0.1:1")
    options = dict(factory.call_args.kwargs["options"])
    assert engine_client.MAX_RECONNECT_BACKOFF_S == 5.0
    assert options["grpc.max_reconnect_backoff_ms"] == 5000
