"""The gRPC API and client disconnects end to end on the embedded default model.

A gRPC client that only has the generated stubs, one that discovers everything by reflection, the
documented gRPC bad inputs, Abort and cancellation; HTTP clients that drop a stream or a request;
a full queue (429 / RESOURCE_EXHAUSTED) and a worker gone (503 / UNAVAILABLE). After every abort,
the scheduler's stats show the request gone and all KV blocks free. One cluster with room for two
running and one waiting request serves the whole module.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from transformers import AutoTokenizer

from services.common.model_files import resolve_model
from services.common.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.cluster import SpindleCluster
from tests.e2e.openai_calls import post_json
from tests.frontend.bad_inputs import GRPC_CASES, doc_cases, param_of_grpc_details
from tests.openai_schema import validate

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
LONG = dict(max_tokens=1000, ignore_eos=True)  # runs until aborted
FINISH = generate_pb2.GenerateResponse.FinishReason


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SpindleCluster(tmp_path_factory.mktemp("logs"), env={
        "SPINDLE_KV_CACHE_BYTES": str(256 * 2**20), "SPINDLE_MAX_MODEL_LEN": "2048", "SPINDLE_NUM_THREADS": "1",
        # Small limits so that a full queue is easy to reach. Two waiting places: the n=2 request's
        # two engine requests may reach the queue in the same engine step.
        "SPINDLE_MAX_NUM_SEQS": "2", "SPINDLE_MAX_NUM_WAITING_REQUESTS": "2",
    })
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.frontend_grpc_addr) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


def stats(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=10) as resp:
        return json.load(resp)


def wait_until(predicate, timeout_s: float = 60.0):
    """Polls `predicate` until it returns something true, and returns that; raises TimeoutError with
    its last value otherwise, so a slow engine is told apart from a wrong state."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {value!r} after {timeout_s} s")
        time.sleep(0.1)


def assert_engine_idle_and_blocks_free(cluster) -> None:
    """The aborted requests are gone from the scheduler and every KV block is back in the pool."""
    idle = cluster.wait_for_idle(timeout_s=60)
    assert idle["num_free_blocks"] == idle["num_total_blocks"], idle


def http_completion(cluster, **fields) -> dict:
    """The HTTP API's answer to the same greedy request, validated as sent."""
    status, body = post_json(cluster, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": 0,
                                                         "return_token_ids": True, **fields})
    assert status == 200, body
    validate(body, "CreateCompletionResponse")
    return body


def generate_request(**fields) -> generate_pb2.GenerateRequest:
    params = fields.pop("params", {})
    return generate_pb2.GenerateRequest(sampling_params=generate_pb2.GenerateRequest.SamplingParams(**params),
                                        **fields)


# --- gRPC with the generated stubs ---------------------------------------------------------------
def test_generated_stubs_client(cluster, stub):
    with grpc.insecure_channel(cluster.frontend_grpc_addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        # gRPC health follows the engine's readiness a moment after HTTP /health does.
        assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service="spindle.v1.GenerateService"),
                                               timeout=10).status == serving)

    info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.model_name, info.max_model_len, info.vocab_size) == (MODEL, 2048, 49152)
    assert list(info.eos_token_ids) == [2]  # <|im_end|>

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None, None).path)
    tokens = stub.Tokenize(generate_pb2.TokenizeRequest(text=PROMPT), timeout=10)
    assert list(tokens.token_ids) == tokenizer.encode(PROMPT)
    assert list(tokens.tokens) == tokenizer.convert_ids_to_tokens(tokenizer.encode(PROMPT))

    by_text = list(stub.Generate(generate_request(text=PROMPT, params={"temperature": 0, "max_tokens": 8}),
                                 timeout=120))
    token_ids = generate_pb2.GenerateRequest.TokenIds(token_ids=tokens.token_ids)
    by_ids = list(stub.Generate(generate_request(token_ids=token_ids, params={"temperature": 0, "max_tokens": 8}),
                                timeout=120))
    text = "".join(r.text for r in by_text)
    http = http_completion(cluster, max_tokens=8)["choices"][0]
    assert text == "".join(r.text for r in by_ids) == http["text"]
    assert [t for r in by_text for t in r.token_ids] == [t for r in by_ids for t in r.token_ids] == http["token_ids"]
    assert by_text[-1].finish_reason == FINISH.FINISH_REASON_LENGTH
    assert [r.finish_reason for r in by_text[:-1]] == [FINISH.FINISH_REASON_UNSPECIFIED] * (len(by_text) - 1)
    assert by_text[-1].num_prompt_tokens == len(tokens.token_ids) and by_text[-1].num_completion_tokens == 8

    stop = text[len(text) // 2:len(text) // 2 + 3]  # greedy again, so the text stops just before this
    choices = list(stub.Generate(generate_request(text=PROMPT, stop=[stop], params={
        "temperature": 0, "max_tokens": 8, "n": 2, "logprobs": 2}), timeout=120))
    for index in (0, 1):
        mine = [r for r in choices if r.index == index]
        assert "".join(r.text for r in mine) == text[:text.index(stop)]
        assert mine[-1].finish_reason == FINISH.FINISH_REASON_STOP
        for r in mine:
            assert len(r.logprobs) == len(r.token_ids)
            for lp, token_id in zip(r.logprobs, r.token_ids):
                # Greedy: the sampled token is the most likely, and exactly 2 alternatives are listed.
                assert lp.rank == 1 and len(lp.top_logprobs) == 2
                assert (lp.top_logprobs[0].token_id, lp.top_logprobs[0].logprob) == (token_id, lp.logprob)
        logprobs = [lp.logprob for r in mine for lp in r.logprobs]
        http = http_completion(cluster, max_tokens=8, stop=[stop], logprobs=2)["choices"][0]
        assert logprobs == pytest.approx(http["logprobs"]["token_logprobs"], abs=1e-4)


# --- gRPC by reflection --------------------------------------------------------------------------
def test_reflection_discovers_and_calls_the_service(cluster):
    with grpc.insecure_channel(cluster.frontend_grpc_addr) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"spindle.v1.GenerateService", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName("spindle.v1.GenerateService")
        methods = {m.name: m for m in service.methods}
        assert {"Generate", "Tokenize", "GetModelInfo", "Abort"} <= set(methods)

        def call(name: str, fields: dict, streaming: bool = False):
            method = methods[name]
            request_class = message_factory.GetMessageClass(method.input_type)
            response_class = message_factory.GetMessageClass(method.output_type)
            make = channel.unary_stream if streaming else channel.unary_unary
            rpc = make(f"/{service.full_name}/{name}", request_serializer=request_class.SerializeToString,
                       response_deserializer=response_class.FromString)
            return rpc(request_class(**fields), timeout=120)

        assert call("GetModelInfo", {}).model_name == MODEL
        # The service's file is self-contained: reflection serves no internal proto along with it.
        assert [d.name for d in pool.FindFileContainingSymbol(service.full_name).dependencies] == []
        params_type = methods["Generate"].input_type.fields_by_name["sampling_params"].message_type
        assert params_type.full_name == "spindle.v1.GenerateRequest.SamplingParams"
        params_class = message_factory.GetMessageClass(params_type)
        responses = list(call("Generate", {"text": PROMPT, "sampling_params": params_class(temperature=0,
                                                                                          max_tokens=4)}, True))
    http = http_completion(cluster, max_tokens=4)["choices"][0]
    assert "".join(r.text for r in responses) == http["text"]
    assert [t for r in responses for t in r.token_ids] == http["token_ids"]


DOC_CASES = doc_cases()


@pytest.mark.parametrize("case", sorted(GRPC_CASES))
def test_documented_grpc_bad_inputs(stub, case):
    method, request = GRPC_CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        result = getattr(stub, method)(request, timeout=30)
        if method == "Generate":
            list(result)
    assert info.value.code().name == DOC_CASES[case].status, info.value.details()
    assert param_of_grpc_details(info.value.details()) == DOC_CASES[case].param


# --- aborts and disconnects ----------------------------------------------------------------------
def test_abort_rpc_cancels_the_call_and_frees_its_blocks(cluster, stub):
    call = stub.Generate(generate_request(request_id="e2e-abort", text=PROMPT, params={"n": 2, **LONG}), timeout=300)
    first = next(call)
    assert first.request_id == "e2e-abort"
    stub.Abort(generate_pb2.AbortRequest(request_id="e2e-abort"), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert_engine_idle_and_blocks_free(cluster)


def test_grpc_client_cancel_frees_the_blocks(cluster, stub):
    call = stub.Generate(generate_request(text=PROMPT, params=LONG), timeout=300)
    next(call)
    assert stats(cluster)["num_running_reqs"] == 1
    call.cancel()
    assert_engine_idle_and_blocks_free(cluster)


def test_dropped_http_stream_frees_the_blocks(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                            n=2, stream=True, max_tokens=1000, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert wait_until(lambda: stats(cluster)["num_running_reqs"] == 2)
    stream.close()
    assert_engine_idle_and_blocks_free(cluster)


def test_dropped_non_streamed_request_frees_the_blocks(cluster):
    body = json.dumps({"model": MODEL, "prompt": PROMPT, **LONG}).encode()
    host, port = "127.0.0.1", cluster.http_port
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body))
        assert wait_until(lambda: stats(cluster)["num_running_reqs"] == 1)
    # The client hung up before any response: the frontend aborts the request.
    assert_engine_idle_and_blocks_free(cluster)


def test_full_queue_is_429_and_resource_exhausted(cluster):
    async def scenario():
        async with openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            def stream():
                return client.completions.create(model=MODEL, prompt=PROMPT, stream=True, max_tokens=1000,
                                                 extra_body={"ignore_eos": True})

            running = [await stream(), await stream()]  # the two running slots
            for s in running:
                await anext(aiter(s))
            # Headers only come with a stream's first chunk, so these stay pending while they wait.
            waiting = [asyncio.create_task(stream()) for _ in range(2)]
            assert await asyncio.to_thread(wait_until, lambda: stats(cluster)["num_waiting_reqs"] == 2)
            with pytest.raises(openai.RateLimitError) as http_error:
                await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            async with grpc.aio.insecure_channel(cluster.frontend_grpc_addr) as channel:
                grpc_stub = generate_pb2_grpc.GenerateServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as grpc_error:
                    [r async for r in grpc_stub.Generate(generate_request(text=PROMPT))]
            for task in waiting:
                task.cancel()
            for s in running:
                await s.close()
            return http_error.value, grpc_error.value

    http_error, grpc_error = asyncio.run(scenario())
    assert http_error.status_code == 429 and http_error.response.headers["Retry-After"] == "1"
    assert grpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_engine_idle_and_blocks_free(cluster)


def test_worker_gone_is_503_and_unavailable(cluster, stub):
    """Last in the module: stops the worker, checks both faces refuse, then brings it back.

    (An idle scheduler learns of the loss from the next step, so the first request may be the one
    that finds out: it fails with 503 too.)"""
    cluster.stop_service("worker")
    try:
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as http_error:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert http_error.value.status_code == 503
        assert http_error.value.response.headers["Retry-After"] == "5"
        with pytest.raises(grpc.RpcError) as grpc_error:
            list(stub.Generate(generate_request(text=PROMPT), timeout=30))
        assert grpc_error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert wait_until(lambda: _status(cluster.base_url + "/health") == 503)
    finally:
        cluster.start_service("worker")
        cluster.wait_healthy()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
