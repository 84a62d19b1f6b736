"""Service-to-service authentication on the real three services (a tiny random Llama).

With tokens: a client without the token, with a wrong one, or with the frontend's (the scheduler's
token) is refused by the scheduler and the worker with UNAUTHENTICATED, health answers without any
credential, and no log line carries a token. With mutual TLS: a client without a certificate from
the CA cannot connect, one with a certificate of the wrong identity gets PERMISSION_DENIED, the
exec health probe connects as the service, and served requests still match transformers' greedy
output, while a second scheduler that tries to take over the worker is refused without touching
the running request."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import signal
import threading
import urllib.request

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from services.common import health_probe
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.worker.scheduler_lease import BUSY
from tests.common.certs import CertificateAuthority, Issued
from tests.e2e.cluster import SpindleCluster
from tests.e2e.parity import Reference, assert_greedy_match, hf_greedy
from tests.e2e.probes import wait_until
from tests.e2e.test_tiny_models import build_tiny_model

SCHEDULER_TOKEN = "scheduler-" + "3f9a1c7e5b2d4086" * 2
WORKER_TOKEN = "worker-" + "a4e8c2f6b0d81937" * 2
WRONG_TOKEN = "not-the-token-0000000000000000"
# A request that cannot end before the test has paused the scheduler (no EOS in its reference).
LONG_MAX_TOKENS = 150
PROMPT_LEN = 30
SEPARATE_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model folder, a prompt and transformers' greedy continuation of it."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-auth"), "llama")
    rng = random.Random("service-auth")
    prompt = [rng.randrange(3, 40000) for _ in range(PROMPT_LEN)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference = hf_greedy(hf, prompt, LONG_MAX_TOKENS)
    assert len(reference.output_token_ids) == LONG_MAX_TOKENS, "the reference ended on EOS: pick another prompt"
    return model_dir, prompt, reference


def _cluster(log_dir, model_dir, service_env) -> SpindleCluster:
    return SpindleCluster(log_dir, env={"SPINDLE_MODEL": str(model_dir), "SPINDLE_KV_CACHE_BYTES": "16MiB"},
                          service_env=service_env)


@pytest.fixture(scope="module")
def token_cluster(tiny, tmp_path_factory):
    cluster = _cluster(tmp_path_factory.mktemp("logs-token"), tiny[0], {
        "frontend": {"SPINDLE_SCHEDULER_TOKEN": SCHEDULER_TOKEN},
        "scheduler": {"SPINDLE_SCHEDULER_TOKEN": SCHEDULER_TOKEN, "SPINDLE_WORKER_TOKEN": WORKER_TOKEN},
        "worker": {"SPINDLE_WORKER_TOKEN": WORKER_TOKEN},
    })
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(root / "ca")
    return {name: ca.issue(f"spindle-{name}") for name in ("frontend", "scheduler", "worker")} | {
        "foreign": CertificateAuthority(root / "other-ca", name="other-ca").issue("spindle-scheduler")}


@pytest.fixture(scope="module")
def tls_cluster(tiny, pki, tmp_path_factory):
    cluster = _cluster(tmp_path_factory.mktemp("logs-tls"), tiny[0],
                       {name: pki[name].env() for name in ("frontend", "scheduler", "worker")})
    try:
        yield cluster.start()
    finally:
        cluster.stop()


# --- clients -----------------------------------------------------------------------------------------
def _channel(address: str, issued: Issued | None = None) -> grpc.Channel:
    if issued is None:
        return grpc.insecure_channel(address, options=SEPARATE_CONNECTION)
    cert, key, ca = issued.read()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), options=SEPARATE_CONNECTION)


def _metadata(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"Bearer {token}")]


def _code(call, is_stream: bool = False) -> grpc.StatusCode:
    """OK, or the status the call (read to its end when a stream) failed with."""
    try:
        result = call()
        if is_stream:
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def scheduler_codes(address: str, issued: Issued | None = None, token: str | None = None) -> dict[str, object]:
    """Status of GetEngineInfo and of a Connect stream for this caller."""
    with _channel(address, issued) as channel:
        stub = engine_core_pb2_grpc.EngineCoreServiceStub(channel)
        metadata = _metadata(token)
        return {
            "GetEngineInfo": _code(lambda: stub.GetEngineInfo(engine_core_pb2.GetEngineInfoRequest(),
                                                              metadata=metadata, timeout=10)),
            "Connect": _code(lambda: stub.Connect(iter([]), metadata=metadata, timeout=10), is_stream=True),
        }


def worker_codes(address: str, issued: Issued | None = None, token: str | None = None) -> dict[str, object]:
    """Status of InitializeKVCache and of an ExecuteModel stream for this caller."""
    with _channel(address, issued) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        metadata = _metadata(token)
        return {
            "InitializeKVCache": _code(lambda: stub.InitializeKVCache(
                worker_pb2.InitializeKVCacheRequest(num_blocks=8), metadata=metadata, timeout=10)),
            "ExecuteModel": _code(lambda: stub.ExecuteModel(iter([]), metadata=metadata, timeout=10), is_stream=True),
        }


def _health(address: str, issued: Issued | None = None) -> int:
    with _channel(address, issued) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _model_name(cluster) -> str:
    with urllib.request.urlopen(cluster.base_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def _complete(cluster, prompt: list[int], max_tokens: int) -> list[int]:
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    resp = client.completions.create(model=_model_name(cluster), prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"return_token_ids": True})
    return resp.choices[0].token_ids


def _num_running(cluster) -> int:
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=10) as resp:
        return json.load(resp)["num_running_reqs"]


def _first_tokens(reference: Reference, num_tokens: int) -> Reference:
    """The reference cut to its first `num_tokens` (greedy decoding of fewer tokens is a prefix)."""
    return dataclasses.replace(reference, output_token_ids=reference.output_token_ids[:num_tokens],
                               step_logits=reference.step_logits[:num_tokens], max_new_tokens=num_tokens)


# --- tokens ------------------------------------------------------------------------------------------
def test_without_the_right_token_the_scheduler_and_the_worker_refuse(token_cluster):
    refused = {"GetEngineInfo": UNAUTHENTICATED, "Connect": UNAUTHENTICATED}
    assert scheduler_codes(token_cluster.scheduler_addr) == refused
    assert scheduler_codes(token_cluster.scheduler_addr, token=WRONG_TOKEN) == refused
    assert scheduler_codes(token_cluster.scheduler_addr, token=WORKER_TOKEN) == refused
    refused = {"InitializeKVCache": UNAUTHENTICATED, "ExecuteModel": UNAUTHENTICATED}
    assert worker_codes(token_cluster.worker_addr) == refused
    assert worker_codes(token_cluster.worker_addr, token=WRONG_TOKEN) == refused
    # What a frontend holds (the scheduler's token) does not open the worker.
    assert worker_codes(token_cluster.worker_addr, token=SCHEDULER_TOKEN) == refused


def test_with_the_right_token_calls_pass_and_the_busy_worker_refuses_a_second_scheduler(token_cluster, tiny):
    _, prompt, reference = tiny
    assert scheduler_codes(token_cluster.scheduler_addr, token=SCHEDULER_TOKEN)["GetEngineInfo"] == grpc.StatusCode.OK
    # The worker's own token gets past authentication, then the one-scheduler rule refuses it.
    assert worker_codes(token_cluster.worker_addr, token=WORKER_TOKEN) == {
        "InitializeKVCache": grpc.StatusCode.FAILED_PRECONDITION, "ExecuteModel": grpc.StatusCode.FAILED_PRECONDITION}
    # Served through the authenticated hops, and untouched by every refused call above.
    assert_greedy_match(_complete(token_cluster, prompt, 24), _first_tokens(reference, 24), "token cluster")


def test_health_answers_without_credentials(token_cluster):
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(token_cluster.scheduler_addr) == _health(token_cluster.worker_addr) == serving


def test_no_log_line_carries_a_token(token_cluster):
    for name in ("frontend", "scheduler", "worker"):
        log = token_cluster.log_tail(name, 10**9)
        assert "refused" in log or name == "frontend", log[-2000:]
        for token in (SCHEDULER_TOKEN, WORKER_TOKEN, WRONG_TOKEN):
            assert token not in log and token[-16:] not in log, name


# --- mutual TLS --------------------------------------------------------------------------------------
def test_without_a_certificate_of_the_ca_nothing_connects(tls_cluster, pki):
    unavailable = grpc.StatusCode.UNAVAILABLE
    for issued in (None, pki["foreign"]):
        assert set(scheduler_codes(tls_cluster.scheduler_addr, issued).values()) == {unavailable}
        assert set(worker_codes(tls_cluster.worker_addr, issued).values()) == {unavailable}
    # TLS that trusts the servers but presents no certificate.
    no_cert = grpc.ssl_channel_credentials(pki["scheduler"].ca_path.read_bytes())
    with grpc.secure_channel(tls_cluster.worker_addr, no_cert, options=SEPARATE_CONNECTION) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        assert _code(lambda: stub.InitializeKVCache(worker_pb2.InitializeKVCacheRequest(num_blocks=8),
                                                    timeout=10)) == unavailable


def test_a_certificate_of_the_wrong_identity_is_denied(tls_cluster, pki):
    # The scheduler admits frontends only; the worker its scheduler only.
    assert scheduler_codes(tls_cluster.scheduler_addr, pki["worker"]) == {
        "GetEngineInfo": PERMISSION_DENIED, "Connect": PERMISSION_DENIED}
    assert worker_codes(tls_cluster.worker_addr, pki["frontend"]) == {
        "InitializeKVCache": PERMISSION_DENIED, "ExecuteModel": PERMISSION_DENIED}
    assert scheduler_codes(tls_cluster.scheduler_addr, pki["frontend"])["GetEngineInfo"] == grpc.StatusCode.OK


def test_health_and_the_exec_probe_over_tls(tls_cluster, pki, monkeypatch):
    serving = health_pb2.HealthCheckResponse.SERVING
    # Health is exempt from the identity check: each service's own certificate may ask.
    assert _health(tls_cluster.scheduler_addr, pki["scheduler"]) == serving
    assert _health(tls_cluster.worker_addr, pki["worker"]) == serving
    for variable, value in pki["worker"].env().items():
        monkeypatch.setenv(variable, value)
    assert health_probe.main([tls_cluster.worker_addr]) == 0
    assert health_probe.main([tls_cluster.scheduler_addr]) == 0


@contextlib.contextmanager
def _scheduler_paused(cluster):
    """No output reaches the frontend while the block lasts, so a running request stays running;
    short, as the frontend's keepalive (10 s + 5 s) would drop a stopped scheduler."""
    cluster.procs["scheduler"].send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        cluster.procs["scheduler"].send_signal(signal.SIGCONT)


def test_served_requests_match_greedy_and_a_second_scheduler_cannot_take_the_worker(tls_cluster, pki, tiny):
    _, prompt, reference = tiny
    result: dict = {}

    def run() -> None:
        try:
            result["token_ids"] = _complete(tls_cluster, prompt, LONG_MAX_TOKENS)
        except Exception as exc:  # recorded for the test to assert on
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: _num_running(tls_cluster) == 1, "the request did not start running")
    with _scheduler_paused(tls_cluster):
        assert thread.is_alive(), result
        # A caller with the scheduler's identity gets past TLS, and is refused by the busy worker.
        assert worker_codes(tls_cluster.worker_addr, pki["scheduler"]) == {
            "InitializeKVCache": grpc.StatusCode.FAILED_PRECONDITION,
            "ExecuteModel": grpc.StatusCode.FAILED_PRECONDITION}
        assert thread.is_alive(), "the request ended while the scheduler was stopped"
    thread.join(120)
    assert not thread.is_alive() and "error" not in result, result
    assert_greedy_match(result["token_ids"], reference, "mTLS cluster, during a refused takeover")
    assert BUSY in tls_cluster.log_tail("worker", 10**9)
