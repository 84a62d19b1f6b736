"""Every bad input gets the right status and an OpenAI error object naming the field."""
from __future__ import annotations

import asyncio
import json

import pytest

from services.frontend.errors import EngineError
from services.frontend.serving_engine import ServerState
from tests.frontend.fakes import FakeEngineClient, app_client, make_tokenizer
from tests.openai_schema import validate

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return {"model": "fake-model", "messages": USER, **fields}


def completion(**fields):
    return {"model": "fake-model", "prompt": "Hello", **fields}


# (path, body, status, param, code); a bytes body is sent as is.
BAD_INPUTS = [
    (CHAT, b"{not json", 400, None, None),
    (CHAT, b"[1, 2]", 400, None, None),
    (CHAT, {"model": "fake-model"}, 400, "messages", None),
    (CHAT, chat(messages=[]), 400, "messages", None),
    (CHAT, chat(messages="hi"), 400, "messages", None),
    (CHAT, chat(messages=["hi"]), 400, "messages[0]", None),
    (CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role", None),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role", None),
    (CHAT, chat(messages=[{"role": "tool", "content": "42", "tool_call_id": "x"}]), 400, "messages[0].role", None),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content", None),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content[0].type", None),
    (CHAT, chat(messages=[{"role": "assistant", "content": "I start"}]), 400, "messages", None),  # template refuses
    (CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    (CHAT, chat(max_tokens=-5), 400, "max_tokens", None),
    (CHAT, chat(max_tokens="ten"), 400, "max_tokens", None),
    (CHAT, chat(max_tokens=1.5), 400, "max_tokens", None),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    (CHAT, chat(max_tokens=10_000), 400, "max_tokens", "context_length_exceeded"),
    (CHAT, chat(messages=[{"role": "user", "content": "word " * 300}]), 400, "messages", "context_length_exceeded"),
    (CHAT, chat(temperature=2.5), 400, "temperature", None),
    (CHAT, chat(temperature=-0.1), 400, "temperature", None),
    (CHAT, chat(temperature="hot"), 400, "temperature", None),
    (CHAT, chat(top_p=0), 400, "top_p", None),
    (CHAT, chat(top_p=1.5), 400, "top_p", None),
    (CHAT, chat(top_k=-2), 400, "top_k", None),
    (CHAT, chat(min_p=2), 400, "min_p", None),
    (CHAT, chat(presence_penalty=3), 400, "presence_penalty", None),
    (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty", None),
    (CHAT, chat(seed="x"), 400, "seed", None),
    (CHAT, chat(n=2), 400, "n", None),
    (CHAT, chat(stream="yes"), 400, "stream", None),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", None),
    (CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage", None),
    (CHAT, chat(stop=[""]), 400, "stop", None),
    (CHAT, chat(stop=5), 400, "stop", None),
    (CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias", None),
    (CHAT, chat(logit_bias={"5": 200}), 400, "logit_bias", None),
    (CHAT, chat(logit_bias={"99999": 1}), 400, "logit_bias", None),  # outside the vocabulary
    (CHAT, chat(stop_token_ids=[99999]), 400, "stop_token_ids", None),
    (CHAT, chat(min_tokens=50, max_tokens=10), 400, "min_tokens", None),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", None),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice", None),
    (CHAT, chat(functions=[{"name": "f"}]), 400, "functions", None),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format.type", None),
    (CHAT, chat(logprobs=True), 400, "logprobs", None),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs", None),
    (CHAT, chat(modalities=["text", "audio"]), 400, "modalities", None),
    (CHAT, chat(model="gpt-4o"), 404, "model", "model_not_found"),
    (CHAT, chat(model=7), 400, "model", None),
    (COMPLETIONS, {"model": "fake-model"}, 400, "prompt", None),
    (COMPLETIONS, completion(prompt=""), 400, "prompt", None),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt", None),
    (COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt", None),
    (COMPLETIONS, completion(prompt=[[1, 2], [3]]), 400, "prompt", None),
    (COMPLETIONS, completion(prompt=[-1]), 400, "prompt", None),
    (COMPLETIONS, completion(prompt=[99999]), 400, "prompt", None),
    (COMPLETIONS, completion(prompt=list(range(3, 300))), 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens", None),
    (COMPLETIONS, completion(max_completion_tokens=0, max_tokens=3), 200, None, None),  # chat-only field ignored
    (COMPLETIONS, completion(n=3), 400, "n", None),
    (COMPLETIONS, completion(best_of=2), 400, "best_of", None),
    (COMPLETIONS, completion(echo=True), 400, "echo", None),
    (COMPLETIONS, completion(suffix="!"), 400, "suffix", None),
    (COMPLETIONS, completion(logprobs=2), 400, "logprobs", None),
    (COMPLETIONS, completion(temperature=9), 400, "temperature", None),
    (COMPLETIONS, completion(model="nope"), 404, "model", "model_not_found"),
]


def _request(client, path, body):
    if isinstance(body, bytes):
        return client.post(path, data=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize("path, body, status, param, code", BAD_INPUTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, *_r) in enumerate(BAD_INPUTS)])
def test_bad_inputs(path, body, status, param, code):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with app_client(engine) as client:
            response = await _request(client, path, body)
            return response.status, await response.json(), engine

    got_status, payload, engine = asyncio.run(scenario())
    assert got_status == status, payload
    if status == 200:
        return
    validate(payload, "ErrorResponse")
    assert payload["error"]["param"] == param
    assert payload["error"]["code"] == code
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]
    assert engine.requests == []  # refused before reaching the engine


def test_accepted_extra_and_annotation_fields_reach_the_engine():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        body = chat(user="u1", metadata={"k": "v"}, store=False, seed=7, top_k=5, min_p=0.1, priority=3,
                    temperature=0.5, top_p=0.9, stop_token_ids=[5], ignore_eos=False, tool_choice="none",
                    response_format={"type": "text"}, logprobs=False, parallel_tool_calls=True, max_tokens=4,
                    some_unknown_field=1)
        async with app_client(engine) as client:
            response = await client.post(CHAT, json=body)
            assert response.status == 200, await response.text()
        return engine.requests[0]

    request = asyncio.run(scenario())
    params = request.sampling_params
    assert (params.seed, params.top_k, params.min_p, params.temperature, params.top_p) == (7, 5, 0.1, 0.5, 0.9)
    assert params.max_tokens == 4 and params.stop_token_ids == (5,)
    assert request.priority == 3
    assert request.request_id.startswith("chatcmpl-")
    assert request.eos_token_ids == (make_tokenizer().eos_token_id,)


def _engine_failure(configure):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        configure(engine)
        async with app_client(engine) as client:
            response = await client.post(CHAT, json=chat())
            return response.status, dict(response.headers), await response.json()

    return asyncio.run(scenario())


@pytest.mark.parametrize("code, status, retry", [
    ("resource_exhausted", 429, True), ("unavailable", 503, True), ("invalid_argument", 400, False),
    ("internal", 500, False),
])
def test_engine_refusals_map_to_http_status(code, status, retry):
    got, headers, payload = _engine_failure(lambda e: setattr(e, "refuse", EngineError("no", code)))
    assert got == status
    validate(payload, "ErrorResponse")
    assert ("Retry-After" in headers) == retry


def test_engine_not_ready_is_503_with_retry_after():
    status, headers, payload = _engine_failure(lambda e: setattr(e, "is_ready", False))
    assert status == 503 and headers["Retry-After"]
    validate(payload, "ErrorResponse")


def test_error_output_before_any_text_is_500():
    status, _, payload = _engine_failure(lambda e: setattr(e, "error_after", 0))
    assert status == 500
    validate(payload, "ErrorResponse")
    assert "kernel exploded" in payload["error"]["message"]


def test_unknown_routes_and_methods_are_json_errors():
    async def scenario():
        async with app_client(FakeEngineClient(make_tokenizer())) as client:
            results = []
            for method, path in [("GET", "/v1/nothing"), ("GET", CHAT), ("GET", "/v1/models/other-model")]:
                response = await client.request(method, path)
                results.append((response.status, await response.json()))
            return results

    (s1, p1), (s2, p2), (s3, p3) = asyncio.run(scenario())
    for payload in (p1, p2, p3):
        validate(payload, "ErrorResponse")
    assert s1 == 404 and s2 == 405 and s3 == 404
    assert p3["error"]["code"] == "model_not_found"


def test_draining_refuses_new_requests_and_fails_health():
    async def scenario():
        state = ServerState()
        state.is_draining = True
        async with app_client(FakeEngineClient(make_tokenizer()), state) as client:
            health = await client.get("/health")
            response = await client.post(CHAT, json=chat())
            return health.status, response.status, await response.json()

    health, status, payload = asyncio.run(scenario())
    assert health == 503 and status == 503
    validate(payload, "ErrorResponse")


def test_body_too_large_is_413_json():
    async def scenario():
        async with app_client(FakeEngineClient(make_tokenizer())) as client:
            big = json.dumps(chat(messages=[{"role": "user", "content": "x" * (33 * 1024 * 1024)}]))
            response = await client.post(CHAT, data=big, headers={"Content-Type": "application/json"})
            return response.status, await response.json()

    status, payload = asyncio.run(scenario())
    assert status == 413
    validate(payload, "ErrorResponse")
