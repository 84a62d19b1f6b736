"""Errors beyond the bad-input table (tests/frontend/test_bad_inputs.py): engine refusals, routes,
draining, body size, accepted annotation fields."""
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


def test_chat_template_refusal_is_a_400_on_messages():
    """Templates raise to refuse e.g. a conversation that starts with the assistant (the fake's does)."""
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with app_client(engine) as client:
            response = await client.post(CHAT, json=chat(messages=[{"role": "assistant", "content": "I start"}]))
            return response.status, await response.json(), engine

    status, payload, engine = asyncio.run(scenario())
    assert status == 400
    validate(payload, "ErrorResponse")
    assert payload["error"]["param"] == "messages" and engine.requests == []


def test_chat_only_field_is_ignored_by_completions():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with app_client(engine) as client:
            response = await client.post(COMPLETIONS, json=completion(max_completion_tokens=0, max_tokens=3))
            return response.status, engine

    status, engine = asyncio.run(scenario())
    assert status == 200 and engine.requests[0].sampling_params.max_tokens == 3


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


@pytest.mark.parametrize("code, status, retry_after", [
    ("resource_exhausted", 429, "1"), ("unavailable", 503, "5"), ("invalid_argument", 400, None),
    ("internal", 500, None),
])
def test_engine_refusals_map_to_http_status(code, status, retry_after):
    got, headers, payload = _engine_failure(lambda e: setattr(e, "refuse", EngineError("no", code)))
    assert got == status
    validate(payload, "ErrorResponse")
    assert headers.get("Retry-After") == retry_after  # seconds: a full queue drains sooner than a lost worker
    assert payload["error"]["message"] == "no"


def test_engine_not_ready_is_503_with_retry_after():
    status, headers, payload = _engine_failure(lambda e: setattr(e, "is_ready", False))
    assert status == 503 and headers["Retry-After"] == "5"
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
