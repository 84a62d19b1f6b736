"""What a rollout and a broken device look like from outside, on the real services (fake-model
workers: the steps are free, so only the services' own behaviour is under test).

- An engine drains (SIGTERM) behind a frontend that reaches engines through a Service (a TCP proxy,
  tests/service_proxy.py): the frontend turns NotReady within a second, the draining engine finishes
  its stream, a request sent during the drain is served by the other engine, and the frontend
  serves again from it; nothing is restarted.
- A sticky device fault (every step fails): after --worker-max-consecutive-failed-steps failed steps
  the worker reports NOT_SERVING, so does the engine, and a restarted worker serves.
"""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import urllib.error
import urllib.request

import pytest

from tests.e2e.cluster import SpindleCluster
from tests.e2e.probes import grpc_serving, wait_until
from tests.service_proxy import ServiceProxy

FAKE_ENGINE_ENV = {"SPINDLE_FAKE_MODEL": "true", "SPINDLE_SHUTDOWN_TIMEOUT": "60", "SPINDLE_MAX_MODEL_LEN": "2048"}
FAULT_TOKEN_ID = 4242
NUM_STREAM_TOKENS = 300


def _http(cluster: SpindleCluster, path: str, body: dict | None = None, timeout_s: float = 60
          ) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(cluster.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.load(resp), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), dict(err.headers)


def _health(cluster: SpindleCluster) -> int:
    return _http(cluster, "/health", timeout_s=5)[0]


def _completion(prompt, max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


@contextlib.contextmanager
def _paused(proc):
    """SIGSTOP: no step of that worker completes while the block lasts (keep it under the
    scheduler's 10 s gRPC keepalive)."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


class _Stream:
    """A streamed completion read in a thread: its data lines, and events for the first and the end."""

    def __init__(self, cluster: SpindleCluster, body: dict):
        self.lines: list[str] = []
        self.status = 0
        self.first, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._run, args=(cluster, body), daemon=True).start()

    def _run(self, cluster: SpindleCluster, body: dict) -> None:
        request = urllib.request.Request(cluster.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                self.status = resp.status
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        self.lines.append(line.removeprefix("data: "))
                        self.first.set()
        finally:
            self.first.set()
            self.done.set()

    def chunks(self) -> list[dict]:
        assert self.lines[-1] == "[DONE]", self.lines[-3:]
        return [json.loads(line) for line in self.lines[:-1]]


@pytest.fixture()
def two_engines(tmp_path):
    """Engines a and b (scheduler + fake worker each) behind one Service (the proxy, on a at first),
    and a's frontend reaching them through it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = SpindleCluster(tmp_path / "a", env={**FAKE_ENGINE_ENV, "SPINDLE_ENGINE_WAIT_TIMEOUT": "20"})
    b = SpindleCluster(tmp_path / "b", env=FAKE_ENGINE_ENV)
    proxy = ServiceProxy(int(a.scheduler_addr.rsplit(":", 1)[1])).start()
    a.service_env = {"frontend": {"SPINDLE_SCHEDULER_ADDR": proxy.address}}
    try:
        for cluster in (a, b):
            cluster.start_service("worker")
            cluster.start_service("scheduler")
        a.start_service("frontend")
        a.wait_healthy(120)
        wait_until(lambda: grpc_serving(b.scheduler_addr), "engine b did not become ready", 120)
        yield a, b, proxy
    finally:
        proxy.close()
        a.stop()
        b.stop()


def test_a_draining_engine_hands_its_frontend_over_to_the_next_engine_without_errors(two_engines):
    a, b, proxy = two_engines
    stream = _Stream(a, _completion("Once upon a time", NUM_STREAM_TOKENS, stream=True))
    assert stream.first.wait(60) and stream.status == 200, (stream.status, stream.lines)
    handed_over: dict = {}
    with _paused(a.procs["worker"]):  # the stream stays in flight on engine a
        a.procs["scheduler"].send_signal(signal.SIGTERM)
        wait_until(lambda: _health(a) == 503, "the frontend stayed Ready while its engine drained", 1.0)

        # Sent while the frontend has no ready engine: it waits for one, it is not refused.
        def send() -> None:
            handed_over["result"] = _http(a, "/v1/completions", _completion("Hello", 4))

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        proxy.backend_port = int(b.scheduler_addr.rsplit(":", 1)[1])  # a left the Service's endpoints
        sender.join(30)
        assert not sender.is_alive(), "the request sent during the drain hung"
        status, body, _ = handed_over["result"]
        # Engine a refuses every new request while it drains: this one was served by b.
        assert status == 200 and body["usage"]["completion_tokens"] == 4, (status, body)
        wait_until(lambda: _health(a) == 200, "the frontend did not serve again from the new engine", 10)
        assert not stream.done.is_set()

    # The draining engine's stream ends complete, without an error, and engine a exits cleanly.
    assert stream.done.wait(60), "the draining engine's stream hung"
    chunks = stream.chunks()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert not any("error" in chunk for chunk in chunks)
    assert a.procs["scheduler"].wait(30) == 0
    status, body, _ = _http(a, "/v1/completions", _completion("Again", 3))
    assert status == 200 and body["usage"]["completion_tokens"] == 3, (status, body)
    assert a.procs["frontend"].poll() is None and b.procs["scheduler"].poll() is None


@pytest.fixture()
def faulty_cluster(tmp_path):
    cluster = SpindleCluster(tmp_path, env={
        **FAKE_ENGINE_ENV,
        "SPINDLE_FAKE_MODEL_FAULT_TOKEN_ID": str(FAULT_TOKEN_ID),
        "SPINDLE_WORKER_MAX_CONSECUTIVE_FAILED_STEPS": "3",
        "SPINDLE_ENGINE_WAIT_TIMEOUT": "0",
    })
    try:
        for name in ("worker", "scheduler", "frontend"):
            cluster.start_service(name)
        cluster.wait_healthy(120)
        yield cluster
    finally:
        cluster.stop()


def test_consecutive_failed_steps_turn_the_worker_not_serving_and_a_restarted_worker_serves(faulty_cluster):
    cluster = faulty_cluster
    worker = cluster.procs["worker"]
    status, body, _ = _http(cluster, "/v1/completions", _completion([FAULT_TOKEN_ID, 5, 6], 4))
    assert status == 500 and "injected device fault" in body["error"]["message"], (status, body)
    # The fault is sticky: the next steps fail too, and the third in a row breaks the worker.
    for _ in range(2):
        status, body, _ = _http(cluster, "/v1/completions", _completion([5, 6, 7], 4))
        assert status in (500, 503), (status, body)
    wait_until(lambda: not grpc_serving(cluster.worker_addr), "the worker stayed SERVING", 10)
    wait_until(lambda: not grpc_serving(cluster.scheduler_addr), "the engine stayed SERVING", 10)
    wait_until(lambda: _health(cluster) == 503, "the frontend stayed Ready", 10)
    status, body, headers = _http(cluster, "/v1/completions", _completion([5, 6, 7], 4))
    assert status == 503 and headers.get("Retry-After"), (status, body, headers)
    assert worker.poll() is None  # broken, not dead: the liveness probe is what restarts it

    worker.kill()  # the kubelet restarting the container
    worker.wait(30)
    cluster.start_service("worker")
    cluster.wait_healthy(120)
    status, body, _ = _http(cluster, "/v1/completions", _completion([5, 6, 7], 4))
    assert status == 200 and body["usage"]["completion_tokens"] == 4, (status, body)
