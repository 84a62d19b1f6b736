"""The SMG gateway (smg 1.13.0, tests/e2e/gateway.py) in front of Spindle's engine gRPC port (vLLM's
`VllmEngine` protocol), end to end on the embedded default model with the official `openai` client.

The gateway templates and tokenizes chats itself, with the tokenizer and chat template it fetched
from the engine (GetTokenizer): the frontend's model folder is gone before the gateway starts, as
on another host. Through it, greedy chat (streamed or not), completions, /v1/responses and
Anthropic's /v1/messages give the texts Spindle's own HTTP API gives for the same prompts; a client
that hangs up aborts the engine request and frees its KV blocks; `tool_choice` and
`response_format` reach the engine as JSON schema constraints, which it enforces. With two engines
behind `--policy cache_aware`, requests sharing a long prefix go to the engine that cached it, and
when that engine crashes the gateway sends them to the other one with no failure the client sees
once requests succeed again.
"""
from __future__ import annotations

import io
import json
import shutil
import signal
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from transformers import AutoTokenizer

from services.common.model_files import resolve_model
from tests.e2e.cluster import SpindleCluster
from tests.e2e.gateway import SmgGateway, smg_binary
from tests.e2e.openai_calls import TOOL_SCHEMAS, TOOLS, chat_text, get_json, template_ids
from tests.openai_schema import COMPLETION_CHUNK, create, stream

MODEL = "SmolLM2-135M-Instruct"
CHAT_SCHEMA, CHUNK_SCHEMA, COMPLETION_SCHEMA = (
    "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse")
# `make gateway`'s flags.
GATEWAY_FLAGS = ("--policy", "cache_aware", "--tool-call-parser", "json")
MAX_TOKENS = 24
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS)
CHATS = {
    "question": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "You are a pirate. Answer in one sentence."},
               {"role": "user", "content": "Where is the treasure?"}],
    "turns": [{"role": "user", "content": "Hi!"},
              {"role": "assistant", "content": "Hello! How can I help you today?"},
              {"role": "user", "content": "Name three colours."}],
}
PROMPTS = ["Once upon a time", "The three primary colours are"]
# A stream cut short: the prompt (about 40 tokens) and this many tokens fit in the 2,048 context.
LONG_MAX_TOKENS = 1900
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population_millions": {"type": "integer"}},
        "required": ["city", "population_millions"], "additionalProperties": False}
# Anthropic's stop reasons for OpenAI's finish reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


@pytest.fixture(scope="module")
def smg() -> Path:
    return smg_binary()  # skips the module before any cluster starts when smg cannot be installed


@pytest.fixture(scope="module")
def model_path() -> Path:
    return resolve_model(None, None).path


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def frontend_model_dir(tmp_path_factory, model_path) -> Path:
    """The model folder without its weights, for the frontend alone (the worker loads the real one)."""
    folder = tmp_path_factory.mktemp("frontend-model") / MODEL
    folder.mkdir()
    for path in model_path.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, folder)
    return folder


def tokenizer_zip(engine_grpc_addr: str) -> zipfile.ZipFile:
    """GetTokenizer's ZIP, as the gateway receives it."""
    with grpc.insecure_channel(engine_grpc_addr) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        data = b"".join(chunk.data for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    return zipfile.ZipFile(io.BytesIO(data))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smg, frontend_model_dir, model_path):
    c = SpindleCluster(tmp_path_factory.mktemp("logs"),
                       env={"SPINDLE_KV_CACHE_BYTES": str(256 * 2**20), "SPINDLE_MAX_MODEL_LEN": "2048"},
                       service_env={"frontend": {"SPINDLE_MODEL": str(frontend_model_dir)}})
    try:
        c.start()
        # The frontend builds the ZIP on first use and keeps it; then its folder goes, so that the
        # gateway (which reads a worker's model folder directly when it exists on its host) has to
        # fetch the tokenizer and its chat template over GetTokenizer.
        bundle = tokenizer_zip(c.engine_grpc_addr)
        assert bundle.read("chat_template.jinja") == (model_path / "chat_template.jinja").read_bytes()
        shutil.rmtree(frontend_model_dir)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def gateway(cluster, smg, tmp_path_factory):
    gw = SmgGateway(smg, [f"grpc://{cluster.engine_grpc_addr}"], tmp_path_factory.mktemp("smg") / "smg.log",
                    GATEWAY_FLAGS)
    try:
        yield gw.start()
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def spindle(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def post_messages(gateway: SmgGateway, body: dict) -> dict:
    """Anthropic's /v1/messages over plain HTTP (the `anthropic` package is not a dependency)."""
    req = urllib.request.Request(gateway.base_url + "/v1/messages", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as err:
        raise AssertionError(f"/v1/messages answered {err.code}: {err.read()[:2000]!r}") from None


# --- the same greedy text as Spindle's own API -----------------------------------------------------
def test_the_gateway_took_the_tokenizer_over_get_tokenizer(gateway, frontend_model_dir):
    (worker,) = gateway.workers()
    assert worker["is_healthy"] and worker["runtime_type"] == "vllm", worker
    # The folder GetModelInfo names is not there: the gateway's tokenizer came from the bundle.
    assert worker["labels"]["model_path"] == str(frontend_model_dir)
    assert not frontend_model_dir.exists()


@pytest.mark.parametrize("messages", CHATS.values(), ids=CHATS.keys())
def test_chat_through_the_gateway_is_spindles_greedy_text(spindle, client, gateway, tokenizer, messages):
    want = create(spindle.chat.completions, CHAT_SCHEMA, model=MODEL, messages=messages, **GREEDY)
    text, finish_reason = want.choices[0].message.content, want.choices[0].finish_reason
    num_prompt_tokens = len(template_ids(tokenizer, messages))
    assert want.usage.prompt_tokens == num_prompt_tokens
    assert chat_text(stream(spindle.chat.completions, CHUNK_SCHEMA, model=MODEL, messages=messages, **GREEDY)) == text

    got = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (text, finish_reason)
    # The model's template, rendered by the gateway: the same prompt, token for token in number.
    assert got.usage.prompt_tokens == num_prompt_tokens
    chunks = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text

    response = client.responses.create(model=MODEL, input=messages, temperature=0.0, max_output_tokens=MAX_TOKENS)
    assert response.output_text == text
    assert response.usage.input_tokens == num_prompt_tokens

    system = [m["content"] for m in messages if m["role"] == "system"]
    message = post_messages(gateway, {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                      **({"system": system[0]} if system else {}),
                                      "messages": [m for m in messages if m["role"] != "system"]})
    assert "".join(block["text"] for block in message["content"] if block["type"] == "text") == text
    assert message["stop_reason"] == STOP_REASONS[finish_reason]
    assert message["usage"]["input_tokens"] == num_prompt_tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_through_the_gateway_are_spindles_greedy_text(spindle, client, prompt):
    want = create(spindle.completions, COMPLETION_SCHEMA, model=MODEL, prompt=prompt, **GREEDY)
    assert stream(spindle.completions, COMPLETION_CHUNK, model=MODEL, prompt=prompt, **GREEDY)
    got = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.choices[0].text, want.choices[0].finish_reason)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text


# --- a client that hangs up --------------------------------------------------------------------------
def test_a_client_hanging_up_on_the_gateway_aborts_the_engine_request(cluster, client):
    before = cluster.wait_for_idle()
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                            stream=True, temperature=0.0, max_tokens=LONG_MAX_TOKENS,
                                            extra_body={"ignore_eos": True})
    received = iter(chunks)
    for _ in range(4):
        next(received)
    assert get_json(cluster, "/stats")["num_running_reqs"] == 1
    chunks.close()
    idle = cluster.wait_for_idle(timeout_s=60)
    assert idle["num_free_blocks"] == idle["num_total_blocks"], idle
    # Far fewer engine steps than tokens asked for: the request was aborted, it did not run out.
    assert idle["num_steps"] - before["num_steps"] < LONG_MAX_TOKENS // 2, (before, idle)


# --- constraints the gateway asks for and the engine enforces ---------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_through_the_gateway_validate_against_the_tool_schema(client, tool_choice):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    got = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS, tool_choice=tool_choice,
                                         temperature=0.0, max_tokens=120)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert {call.function.name for call in choice.message.tool_calls} == {"add"}


def test_response_format_through_the_gateway_is_enforced(client):
    question = [{"role": "user", "content": "Which city is the capital of France, and how many people live there?"}]
    free = client.chat.completions.create(model=MODEL, messages=question, temperature=0.0, max_tokens=60)
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model answers in prose
        json.loads(free.choices[0].message.content)
    got = client.chat.completions.create(model=MODEL, messages=question, temperature=0.0, max_tokens=60,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "city", "schema": CITY}})
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), CITY)


# --- two engines behind one cache-aware gateway -----------------------------------------------------
# About 1,000 tokens (980 with SmolLM2's tokenizer) of text no other test sends.
SHARED_PREFIX = " ".join(f"Item {i}: the lighthouse keeper counts ships." for i in range(90))
NUM_PREFIX_REQUESTS = 6
NUM_REQUESTS_AFTER_FAILOVER = 6
MAX_FAILOVER_S = 120.0  # a bound on the wait, not an assertion on its length


@pytest.fixture
def two_clusters(tmp_path):
    """Two engines, each frontend + scheduler + worker, started side by side."""
    clusters = [SpindleCluster(tmp_path / f"engine{i}", env={"SPINDLE_KV_CACHE_BYTES": str(128 * 2**20),
                                                              "SPINDLE_MAX_MODEL_LEN": "2048"})
                for i in range(2)]
    try:
        for c in clusters:
            c.log_dir.mkdir()
            for name in ("worker", "scheduler", "frontend"):  # both load their model at once
                c.start_service(name)
        for c in clusters:
            c.wait_healthy()
        yield clusters
    finally:
        for c in clusters:
            c.stop()


def prefix_counters(cluster: SpindleCluster) -> tuple[int, int]:
    stats = get_json(cluster, "/stats")
    return stats["prefix_cache_queries"], stats["prefix_cache_hits"]


def test_cache_aware_routing_follows_the_cached_prefix_and_survives_an_engine_crash(smg, tokenizer, two_clusters,
                                                                                      tmp_path):
    assert 900 <= len(tokenizer.encode(SHARED_PREFIX)) <= 1100
    gw = SmgGateway(smg, [f"grpc://{c.engine_grpc_addr}" for c in two_clusters], tmp_path / "smg.log",
                    ("--policy", "cache_aware"))
    try:
        gw.start()
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(suffix: str):
            return client.completions.create(model=MODEL, prompt=SHARED_PREFIX + suffix, max_tokens=4, temperature=0.0)

        complete("")  # the prefix lands on one engine
        before = [prefix_counters(c) for c in two_clusters]
        for k in range(NUM_PREFIX_REQUESTS):
            assert complete(f" Question {k}: how many ships?").usage.prompt_tokens_details.cached_tokens >= 900
        after = [prefix_counters(c) for c in two_clusters]
        num_hits = [a[1] - b[1] for a, b in zip(after, before)]
        num_queries = [a[0] - b[0] for a, b in zip(after, before)]
        holder = max(range(2), key=lambda i: num_hits[i])
        # Every request went to the engine that cached the prefix, and found it there.
        assert num_hits[holder] >= NUM_PREFIX_REQUESTS * 900, (num_hits, num_queries)
        assert num_hits[1 - holder] == 0 and num_queries[1 - holder] == 0, (num_hits, num_queries)

        # The engine holding the prefix crashes (its frontend killed outright): the gateway finds
        # out on its own and sends requests to the other engine.
        crashed, survivor = two_clusters[holder], two_clusters[1 - holder]
        survivor_before = prefix_counters(survivor)
        killed_at = time.monotonic()
        crashed.stop_service("frontend", signal.SIGKILL)
        failures: list[str] = []
        num_ok, first_ok_s = 0, None
        while num_ok < NUM_REQUESTS_AFTER_FAILOVER:
            try:
                complete(f" Question {len(failures) + num_ok}: after the storm?")
            except openai.APIError as exc:
                assert first_ok_s is None, f"a request failed after requests succeeded again: {exc!r}"
                failures.append(repr(exc))
                assert time.monotonic() - killed_at < MAX_FAILOVER_S, failures
                continue
            num_ok += 1
            if first_ok_s is None:
                first_ok_s = time.monotonic() - killed_at
        print(f"\nfailover: first success {first_ok_s:.2f} s after the kill, {len(failures)} failed requests "
              f"before it: {failures}")
        queries, hits = (a - b for a, b in zip(prefix_counters(survivor), survivor_before))
        # All of them ran on the survivor, which now caches the prefix itself.
        assert queries >= NUM_REQUESTS_AFTER_FAILOVER * 900
        assert hits >= (NUM_REQUESTS_AFTER_FAILOVER - 1) * 900, (queries, hits)
    finally:
        gw.stop()
