"""End to end on the embedded default model: three processes, the official openai client, HF as oracle.

Every response body and stream event is validated against the OpenAI description as it came over
the wire (tests/openai_schema.py), not as the client rebuilt it.
"""
from __future__ import annotations

import asyncio
import functools
import json

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.model_files import resolve_model
from tests.e2e.cluster import SpindleCluster
from tests.e2e.openai_calls import BLOCK_SIZE, EOS, chat_text, post_json, template_ids
from tests.e2e.parity import assert_greedy_match, hf_greedy
from tests.openai_schema import COMPLETION_CHUNK, acreate, create, stream, validate, validate_body

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
CHAT = "CreateChatCompletionResponse"


@pytest.fixture(scope="module")
def model():
    return resolve_model(None, None)


@functools.lru_cache(maxsize=1)
def _load(path: str) -> tuple:
    """The tokenizer and the transformers model, loaded once per process for every fixture here."""
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(model):
    return _load(str(model.path))[0]


@pytest.fixture(scope="module")
def hf(model):
    return _load(str(model.path))[1]


@pytest.fixture(scope="module")
def references(model):  # only `model`: tests/gpu imports this fixture with it
    tokenizer, hf = _load(str(model.path))
    return [hf_greedy(hf, template_ids(tokenizer, [{"role": "user", "content": p}]), MAX_TOKENS) for p in PROMPTS]


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
    resp = create(client.chat.completions, CHAT, model=model.name, messages=[{"role": "user", "content": prompt}],
                  max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    return resp.choices[0].token_ids


def test_greedy_chat_matches_transformers_sequentially(client, model, references):
    for prompt, ref in zip(PROMPTS, references):
        assert_greedy_match(chat_ids(client, model, prompt), ref, prompt)


async def _chat_all(cluster, model) -> list:
    async with openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=300) as aclient:
        return await asyncio.gather(*[
            acreate(aclient.chat.completions, CHAT, model=model.name, messages=[{"role": "user", "content": p}],
                    max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
            for p in PROMPTS
        ])


def test_greedy_chat_matches_transformers_concurrently(cluster, model, references):
    for prompt, ref, resp in zip(PROMPTS, references, asyncio.run(_chat_all(cluster, model))):
        assert_greedy_match(resp.choices[0].token_ids, ref, prompt)


def test_capital_of_france(client, model, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    raw = client.chat.completions.with_raw_response.create(model=model.name, messages=messages, temperature=0,
                                                           max_tokens=20, extra_body={"return_token_ids": True})
    body = validate_body(raw.content, CHAT)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "The capital of France is Paris.", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == EOS
    assert tokenizer.decode(choice["token_ids"][:-1]) == choice["message"]["content"]
    prompt_ids = template_ids(tokenizer, messages)
    assert body["prompt_token_ids"] == prompt_ids
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])  # EOS counts, as in OpenAI's usage
    assert body["usage"]["total_tokens"] == len(prompt_ids) + len(choice["token_ids"])
    # The same wire body without a required field fails: the check above could have failed.
    for broken in ({k: v for k, v in body.items() if k != "created"},
                   {**body, "choices": [{k: v for k, v in choice.items() if k != "index"}]}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, CHAT)


def test_streaming_and_non_streaming_give_the_same_text(client, model):
    for prompt in PROMPTS[:3]:
        messages = [{"role": "user", "content": prompt}]
        full = create(client.chat.completions, CHAT, model=model.name, messages=messages, max_tokens=MAX_TOKENS,
                      temperature=0)
        chunks = stream(client.chat.completions, "CreateChatCompletionStreamResponse", model=model.name,
                        messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert chat_text(chunks) == full.choices[0].message.content
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert reasons == [None] * (len(chunks) - 1) + [full.choices[0].finish_reason]


def test_completions_models_and_streaming_through_openai_client(client, model, tokenizer, hf):
    raw_models = client.models.with_raw_response.list()
    assert [m["id"] for m in validate_body(raw_models.content, "ListModelsResponse")["data"]] == [model.name]

    prompt = "The capital of France is"
    full = create(client.completions, "CreateCompletionResponse", model=model.name, prompt=prompt, max_tokens=8,
                  temperature=0, extra_body={"return_token_ids": True})
    assert_greedy_match(full.choices[0].token_ids, hf_greedy(hf, tokenizer.encode(prompt), 8), prompt)
    assert full.choices[0].text == tokenizer.decode(full.choices[0].token_ids)
    chunks = stream(client.completions, COMPLETION_CHUNK, model=model.name, prompt=prompt, max_tokens=8,
                    temperature=0)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full.choices[0].text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_all_kv_blocks_return_after_finish_and_abort(cluster, client, model):
    for prompt in PROMPTS[:4]:
        client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=8)
    # A stream dropped after its first chunk aborts the request.
    dropped = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                             max_tokens=200, stream=True)
    next(iter(dropped))
    dropped.close()
    stats = cluster.wait_for_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "SmolLM2-135M-Instruct"}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
    (json.dumps({"messages": [{"role": "user", "content": "hello " * 3000}]}).encode(), 400, "messages"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(cluster, client, model, body, status, param):
    got_status, error = post_json(cluster, "/v1/chat/completions", body)
    assert got_status == status, error
    validate(error, "ErrorResponse")
    assert error["error"]["param"] == param
    ok = create(client.chat.completions, CHAT, model=model.name, messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 2


def test_grpc_generate_streams_the_same_greedy_text(cluster, client, model):
    import grpc

    from services.common.pb import generate_pb2, generate_pb2_grpc

    prompt = "The capital of France is"
    http = create(client.completions, "CreateCompletionResponse", model=model.name, prompt=prompt, max_tokens=8,
                  temperature=0, extra_body={"return_token_ids": True})
    with grpc.insecure_channel(cluster.frontend_grpc_addr) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            text=prompt, sampling_params=generate_pb2.GenerateRequest.SamplingParams(temperature=0, max_tokens=8))
        responses = list(stub.Generate(request, timeout=60))
    assert "".join(r.text for r in responses) == http.choices[0].text
    assert [t for r in responses for t in r.token_ids] == http.choices[0].token_ids
    assert responses[-1].finish_reason == generate_pb2.GenerateResponse.FINISH_REASON_LENGTH
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
    before = constrained_cluster.wait_for_idle()
    for prompt, ref, resp in zip(PROMPTS, references, asyncio.run(_chat_all(constrained_cluster, model))):
        assert_greedy_match(resp.choices[0].token_ids, ref, prompt)
    after = constrained_cluster.wait_for_idle()
    assert after["num_preemptions"] > before["num_preemptions"], "the small KV cache should force preemption"
    assert after["num_free_blocks"] == after["num_total_blocks"]


SYSTEM_PROMPT = ("You are a meticulous assistant for a public library. " * 30).strip()


def test_shared_system_prompt_is_served_from_the_prefix_cache(client, model, tokenizer):
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
                     for question in ("Where are the atlases?", "When do you open on Sundays?")]
    usages = []
    for messages in conversations:
        chunks = stream(client.chat.completions, "CreateChatCompletionStreamResponse",
                        model=model.name, max_tokens=4, temperature=0, stream_options={"include_usage": True},
                        messages=messages)
        usages.append(chunks[-1]["usage"])
    cold_ids, warm_ids = (template_ids(tokenizer, m) for m in conversations)
    shared = next(i for i, (a, b) in enumerate(zip(cold_ids, warm_ids)) if a != b)
    assert [u["prompt_tokens"] for u in usages] == [len(cold_ids), len(warm_ids)]
    # Nothing before shares a block with this system prompt; the second request reuses every full
    # block of the common prefix (never the prompt's last token, which must be computed).
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    expected = min(shared, len(warm_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert usages[1]["prompt_tokens_details"] == {"cached_tokens": expected}


def test_wait_for_idle_raises_on_timeout_with_the_last_stats(tmp_path):
    """A request that never leaves the engine is a TimeoutError showing the stats, not stale stats that
    a caller would read as leaked blocks. A stub /stats that always reports one running request."""
    import http.server
    import threading

    busy = {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_free_blocks": 3, "num_total_blocks": 16}

    class BusyStats(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(busy).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BusyStats)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        stub = SpindleCluster(tmp_path)
        stub.http_port = server.server_address[1]
        with pytest.raises(TimeoutError, match="'num_running_reqs': 1.*'num_free_blocks': 3"):
            stub.wait_for_idle(timeout_s=0.5)
        busy["num_running_reqs"] = 0
        assert stub.wait_for_idle(timeout_s=0.5) == busy
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
