"""One request never harms another, and a hung worker is noticed, against the three services.

A rogue client connected straight to the scheduler's EngineCoreService (the generated stubs and
nothing else) aborts an ordinary HTTP stream's request, submits requests under its id, and sends a
token outside the vocabulary; the stream still completes with exactly the tokens of a greedy run
of the same request alone. The worker is stopped (SIGSTOP) while the rogue acts, so the stream is
provably mid-flight. Then a worker stopped for good is detected within the step timeout: the stream
ends with the error, /health answers 503, and after SIGCONT the engine serves correct greedy output.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import queue
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from services.common import codec
from services.common.messages import EngineCoreOutput, FinishReason
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from tests.e2e.cluster import SpindleCluster
from tests.e2e.probes import health_status, wait_until
from tests.e2e.test_tiny_models import build_tiny_model
from tests.step_outputs import per_request

MAX_MODEL_LEN = 4096  # the random model needs no trained positions: long requests can run
VICTIM_MAX_TOKENS = 400  # seconds of decoding: the worker is stopped long before it could finish
MESSAGES = [{"role": "user", "content": "Name three rivers."}]
STEP_TIMEOUT_S = 3
DETECTION_BOUND_S = 30  # generous, past the step timeout: this machine's CPUs are shared


def _tiny_model(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    config_file.write_text(json.dumps(config))
    return model_dir


def _started(cluster: SpindleCluster):
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    yield from _started(SpindleCluster(tmp_path_factory.mktemp("logs"), env={
        "SPINDLE_MODEL": str(model_dir), "SPINDLE_KV_CACHE_BYTES": "16MiB"}))


def _body(max_tokens: int) -> dict:
    # No "model": the frontend serves one, and answers for it.
    return {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _post(cluster, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(cluster.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _greedy_text(cluster, max_tokens: int) -> str:
    status, body = _post(cluster, _body(max_tokens))
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == max_tokens
    return body["choices"][0]["message"]["content"]


class Stream:
    """One streamed chat completion read in a thread: its request id, text, finish and error."""

    def __init__(self, cluster, body: dict):
        self.request_id: str | None = None
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.error: dict | None = None
        self.is_done_marked = False  # saw `data: [DONE]`
        self.started, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._run, args=(cluster.http_port, {**body, "stream": True}), daemon=True).start()

    def _run(self, port: int, body: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    self.is_done_marked = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    self.error = event["error"]
                    continue
                self.request_id = event["id"]
                self.started.set()
                for choice in event["choices"]:
                    self.text.append(choice["delta"].get("content") or "")
                    self.finish_reason = choice["finish_reason"] or self.finish_reason
        finally:
            conn.close()
            self.started.set()
            self.done.set()


class RogueFrontend:
    """A client of the scheduler's EngineCoreService built from the generated stubs: it sends what
    it likes, and reads one output per request per step."""

    def __init__(self, scheduler_addr: str):
        self.channel = grpc.insecure_channel(scheduler_addr)
        self.stub = engine_core_pb2_grpc.EngineCoreServiceStub(self.channel)
        self._requests: queue.Queue = queue.Queue()
        self.outputs: queue.Queue[EngineCoreOutput] = queue.Queue()
        self._responses = self.stub.Connect(iter(self._requests.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        decoder = codec.OutputsDecoder()  # steady steps leave the ids out: the proto says how
        with contextlib.suppress(grpc.RpcError):
            for response in self._responses:
                for output in per_request(decoder.decode(response.outputs)):
                    self.outputs.put(output)

    def vocab_size(self) -> int:
        return self.stub.GetEngineInfo(engine_core_pb2.GetEngineInfoRequest(), timeout=10).vocab_size

    def add(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 8) -> None:
        params = engine_core_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self._requests.put(engine_core_pb2.ConnectRequest(add_request=engine_core_pb2.EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
            arrival_time=time.time())))

    def abort(self, request_id: str) -> None:
        self._requests.put(engine_core_pb2.ConnectRequest(
            abort_requests=engine_core_pb2.AbortRequests(request_ids=[request_id])))

    def take_outputs(self, num_outputs: int, timeout_s: float = 10) -> list[EngineCoreOutput]:
        """Up to `num_outputs` outputs, as many as came within the bound (the caller checks them)."""
        taken: list[EngineCoreOutput] = []
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Empty):
            while len(taken) < num_outputs:
                taken.append(self.outputs.get(timeout=max(deadline - time.monotonic(), 0)))
        return taken

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()


@contextlib.contextmanager
def _worker_stopped(cluster):
    """No step completes while the block lasts, however fast or slow the machine."""
    cluster.procs["worker"].send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        cluster.procs["worker"].send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def reference_text(cluster) -> str:
    return _greedy_text(cluster, VICTIM_MAX_TOKENS)


def _start_victim(cluster) -> Stream:
    victim = Stream(cluster, _body(VICTIM_MAX_TOKENS))
    assert victim.started.wait(120) and victim.request_id, "the stream did not start"
    return victim


def _assert_victim_complete_and_correct(victim: Stream, reference_text: str) -> None:
    assert victim.done.wait(120), "the stream did not complete"
    assert victim.error is None, victim.error
    assert victim.finish_reason == "length" and victim.is_done_marked
    assert "".join(victim.text) == reference_text


def _assert_refused(output: EngineCoreOutput, request_id: str, words: str) -> None:
    assert output.request_id == request_id, output
    assert output.finish_reason == FinishReason.ERROR and output.error_code == "invalid_argument", output
    assert words in output.error_message, output


def test_a_rogue_client_can_neither_abort_nor_take_over_a_running_stream(cluster, reference_text):
    rogue = RogueFrontend(cluster.scheduler_addr)
    try:
        victim = _start_victim(cluster)
        with _worker_stopped(cluster):
            assert not victim.done.is_set(), "the stream finished before the worker was stopped"
            rogue.abort(victim.request_id)  # not the rogue's request: ignored
            rogue.add(victim.request_id, [100, 101, 102])  # its own request under the same id
            rogue.add(victim.request_id, [100, 101, 102])  # a duplicate of its own: refused
            rogue.abort(victim.request_id)  # aborts the rogue's own request, not the stream
            rogue.add("marker", [])  # refused at once: the scheduler has read everything before it
            refusals = rogue.take_outputs(2)
        _assert_victim_complete_and_correct(victim, reference_text)
        assert len(refusals) == 2, refusals
        _assert_refused(refusals[0], victim.request_id, "duplicate request id")
        _assert_refused(refusals[1], "marker", "the prompt is empty")
        idle = cluster.wait_for_idle()
        assert idle["num_free_blocks"] == idle["num_total_blocks"], idle
        assert rogue.outputs.empty()  # the rogue's aborted request sent it nothing
    finally:
        rogue.close()


def test_a_rogue_token_outside_the_vocabulary_fails_alone(cluster, reference_text):
    rogue = RogueFrontend(cluster.scheduler_addr)
    try:
        vocab_size = rogue.vocab_size()
        victim = _start_victim(cluster)
        with _worker_stopped(cluster):  # the rogue's request would share the stream's next step
            assert not victim.done.is_set(), "the stream finished before the worker was stopped"
            rogue.add("rogue-oov", [5, vocab_size, 7])
            refusals = rogue.take_outputs(1)  # at once, before any step
        _assert_victim_complete_and_correct(victim, reference_text)
        assert len(refusals) == 1, "the rogue's request was not refused at the door"
        _assert_refused(refusals[0], "rogue-oov",
                        f"prompt_token_ids: token id {vocab_size} is outside [0, {vocab_size})")
    finally:
        rogue.close()


@pytest.fixture()
def hang_cluster(model_dir, tmp_path):
    yield from _started(SpindleCluster(tmp_path, env={
        "SPINDLE_MODEL": str(model_dir), "SPINDLE_KV_CACHE_BYTES": "16MiB",
        "SPINDLE_WORKER_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S)}))


def test_a_stopped_worker_is_detected_within_the_step_timeout_and_the_engine_recovers(hang_cluster):
    cluster = hang_cluster
    before = _greedy_text(cluster, 24)
    victim = Stream(cluster, _body(MAX_MODEL_LEN - 100))  # would run for minutes
    assert victim.started.wait(120), "the stream did not start"
    worker = cluster.procs["worker"]
    worker.send_signal(signal.SIGSTOP)
    try:
        assert victim.done.wait(STEP_TIMEOUT_S + DETECTION_BOUND_S), "a stream on a stopped worker hung"
        assert victim.error is not None and victim.is_done_marked, victim.error
        assert victim.error["code"] == "service_unavailable", victim.error
        assert "did not answer step" in victim.error["message"], victim.error
        assert victim.error["message"].endswith(f"within {STEP_TIMEOUT_S} s"), victim.error
        wait_until(lambda: health_status(cluster) == 503, "/health did not turn 503", DETECTION_BOUND_S)
        status, refused = _post(cluster, _body(4))
        assert status == 503, refused
    finally:
        worker.send_signal(signal.SIGCONT)
    cluster.wait_healthy(timeout_s=120)
    assert _greedy_text(cluster, 24) == before
