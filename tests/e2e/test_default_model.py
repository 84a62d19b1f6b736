"""End to end on the embedded default model: three processes, the official openai client, HF as oracle."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.model_files import resolve_model
from tests.e2e.cluster import SpindleCluster
from tests.e2e.parity import assert_greedy_match, hf_greedy
from tests.openai_schema import validate

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painter.",
    "Give me a tip for learning to code.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return resolve_model(None, None)


@pytest.fixture(scope="module")
def references(model):
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    refs = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        refs.append(hf_greedy(hf, list(ids), MAX_TOKENS))
    return refs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SpindleCluster(tmp_path_factory.mktemp("logs"), env={"SPINDLE_KV_CACHE_BYTES": str(256 * 2**20), "SPINDLE_MAX_MODEL_LEN": "2048"})
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_ids(client, model, prompt: str) -> list[int]:
    resp = client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True},
    )
    validate(resp.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    return resp.choices[0].token_ids


def test_greedy_chat_matches_transformers_sequentially(client, model, references):
    for prompt, ref in zip(PROMPTS, references):
        assert_greedy_match(chat_ids(client, model, prompt), ref, prompt)


def test_greedy_chat_matches_transformers_concurrently(cluster, model, references):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                     timeout=300)
        resps = await asyncio.gather(*[
            aclient.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"return_token_ids": True})
            for p in PROMPTS
        ])
        await aclient.close()
        return resps

    for prompt, ref, resp in zip(PROMPTS, references, asyncio.run(run())):
        assert_greedy_match(resp.choices[0].token_ids, ref, prompt)


def test_capital_of_france(client, model):
    resp = client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        max_tokens=20)
    assert resp.choices[0].message.content == "The capital of France is Paris."
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0


def test_streaming_and_non_streaming_give_the_same_text(client, model):
    for prompt in PROMPTS[:3]:
        messages = [{"role": "user", "content": prompt}]
        full = client.chat.completions.create(model=model.name, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0)
        chunks = list(client.chat.completions.create(model=model.name, messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True))
        for chunk in chunks:
            validate(chunk.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionStreamResponse")
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == full.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_completions_models_and_streaming_through_openai_client(client, model):
    models = client.models.list()
    validate(models.model_dump(mode="json", exclude_unset=True), "ListModelsResponse")
    assert [m.id for m in models.data] == [model.name]

    full = client.completions.create(model=model.name, prompt="The capital of France is", max_tokens=8,
                                     temperature=0)
    validate(full.model_dump(mode="json", exclude_unset=True), "CreateCompletionResponse")
    streamed = client.completions.create(model=model.name, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == full.choices[0].text and len(text) > 0


def test_all_kv_blocks_return_after_finish_and_abort(cluster, client, model):
    for prompt in PROMPTS[:4]:
        client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=8)
    # A stream dropped after its first chunk aborts the request.
    stream = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=200, stream=True)
    next(iter(stream))
    stream.close()
    stats = wait_for_idle(cluster)
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def wait_for_idle(cluster, timeout_s: float = 10.0) -> dict:
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(cluster.base_url + "/stats", timeout=5) as resp:
            stats = json.load(resp)
        if (stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _post(cluster, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(cluster.base_url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "SmolLM2-135M-Instruct"}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
    (json.dumps({"messages": [{"role": "user", "content": "hello " * 3000}]}).encode(), 400, "messages"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(cluster, client, model, body, status, param):
    got_status, error = _post(cluster, "/v1/chat/completions", body)
    assert got_status == status, error
    validate(error, "ErrorResponse")
    assert error["error"]["param"] == param
    ok = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_grpc_generate_streams_the_same_greedy_text(cluster, client, model):
    import grpc

    from services.common.pb import engine_core_pb2, generate_pb2, generate_pb2_grpc

    prompt = "The capital of France is"
    http = client.completions.create(model=model.name, prompt=prompt, max_tokens=8, temperature=0)
    with grpc.insecure_channel(cluster.frontend_grpc_addr) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            text=prompt, sampling_params=engine_core_pb2.SamplingParams(temperature=0, max_tokens=8))
        responses = list(stub.Generate(request, timeout=60))
    assert "".join(r.text for r in responses) == http.choices[0].text
    assert responses[-1].finish_reason == engine_core_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in responses) == 8


# 17 blocks of 737,280 bytes (30 layers x 3 KV heads x 64 dims x 16 slots x K,V x 4 bytes), 16 usable:
# each prompt (about 37 tokens, its first block shared through the prefix cache) is admitted with two
# new blocks, then the requests outgrow the cache as they decode, so some are preempted; a token
# budget of 32 chunks every prompt's prefill.
CONSTRAINED_ENV = {"SPINDLE_KV_CACHE_BYTES": str(17 * 737_280), "SPINDLE_MAX_MODEL_LEN": "256",
                   "SPINDLE_MAX_NUM_BATCHED_TOKENS": "32"}


@pytest.fixture(scope="module")
def constrained_cluster(tmp_path_factory):
    c = SpindleCluster(tmp_path_factory.mktemp("constrained"), env=CONSTRAINED_ENV)
    try:
        yield c.start()
    finally:
        c.stop()


def test_greedy_parity_under_preemption_and_chunked_prefill(constrained_cluster, model, references):
    before = wait_for_idle(constrained_cluster)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=constrained_cluster.base_url + "/v1", api_key="unused",
                                     max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[
                aclient.chat.completions.create(
                    model=model.name, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS,
                    temperature=0, extra_body={"return_token_ids": True})
                for p in PROMPTS
            ])
        finally:
            await aclient.close()

    for prompt, ref, resp in zip(PROMPTS, references, asyncio.run(run())):
        assert_greedy_match(resp.choices[0].token_ids, ref, prompt)
    after = wait_for_idle(constrained_cluster)
    assert after["num_preemptions"] > before["num_preemptions"], "the small KV cache should force preemption"
    assert after["num_free_blocks"] == after["num_total_blocks"]


SYSTEM_PROMPT = ("You are a meticulous assistant for a public library. " * 30).strip()


def test_shared_system_prompt_is_served_from_the_prefix_cache(cluster, model):
    import time

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    shared = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}], tokenize=True)
    shared = shared["input_ids"] if hasattr(shared, "keys") else shared
    timings = []
    for question in ("Where are the atlases?", "When do you open on Sundays?"):
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=model.name, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}])
        ttft, usage = None, None
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
            usage = chunk.usage or usage
        timings.append((ttft, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
    print(f"shared prefix {len(shared)} tokens; (TTFT s, cached, prompt) cold {timings[0]}, warm {timings[1]}")
    assert timings[1][1] >= 0.9 * len(shared)
