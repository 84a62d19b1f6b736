"""Chat and completions against a fake engine: JSON and SSE shapes, schemas, text, stops, aborts."""
from __future__ import annotations

import asyncio
from importlib import metadata

import jsonschema
import pytest

from tests.frontend.fakes import FakeEngineClient, app_client, make_tokenizer, read_sse, wait_until
from tests.openai_schema import COMPLETION_CHUNK, validate, validate_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Say hello"}]
MULTI_BYTE = "日本語 😀😀 👍🏽 café 中文"


def _run(engine: FakeEngineClient, path: str, body: dict):
    """Non-streamed and streamed responses to the same body."""
    async def scenario():
        async with app_client(engine) as client:
            full = await client.post(path, json=body)
            assert full.status == 200, await full.text()
            full_json = await full.json()
            stream = await client.post(path, json={**body, "stream": True,
                                                   "stream_options": {"include_usage": True}})
            assert stream.status == 200, await stream.text()
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            chunks, _ = await read_sse(stream)
            return full_json, chunks

    return asyncio.run(scenario())


def _chat_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("reply", ["Hello world.", MULTI_BYTE])
def test_chat_full_and_streamed_agree_and_validate(reply):
    engine = FakeEngineClient(make_tokenizer(), reply, num_cached_tokens=16)
    full, chunks = _run(engine, CHAT, {"model": "fake-model", "messages": USER})

    validate(full, "CreateChatCompletionResponse")
    choice = full["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": reply, "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    usage = full["usage"]
    assert usage["completion_tokens"] == len(engine.reply_token_ids) + 1  # + EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == len(engine.requests[0].prompt_token_ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16

    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
        assert chunk["id"] == chunks[0]["id"] and chunk["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _chat_text(chunks) == reply  # byte-identical to the non-streamed text
    assert _chat_text(chunks).encode() == full["choices"][0]["message"]["content"].encode()
    assert not any("\ufffd" in (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "stop" and not any(reasons[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    assert engine.aborted == []


@pytest.mark.parametrize("reply", ["Hello world.", MULTI_BYTE])
def test_completion_full_and_streamed_agree_and_validate(reply):
    engine = FakeEngineClient(make_tokenizer(), reply)
    full, chunks = _run(engine, COMPLETIONS, {"model": "fake-model", "prompt": "Say hello", "max_tokens": 100})

    validate(full, "CreateCompletionResponse")
    assert full["object"] == "text_completion" and full["id"].startswith("cmpl-")
    assert full["choices"][0]["text"] == reply
    for chunk in chunks[:-1]:
        validate(chunk, COMPLETION_CHUNK)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["stop"]
    validate(chunks[-1], "CreateCompletionResponse")  # the usage chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == reply
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def _without(body: dict, path: tuple) -> dict:
    """A deep copy of `body` without the field at `path` (keys and list indices)."""
    import copy

    broken = copy.deepcopy(body)
    *parents, last = path
    node = broken
    for key in parents:
        node = node[key]
    del node[last]
    return broken


REQUIRED = [("created",), ("object",), ("id",), ("choices", 0, "index"), ("choices", 0, "finish_reason")]


@pytest.mark.parametrize("path, schema", [(CHAT, "CreateChatCompletionResponse"),
                                          (COMPLETIONS, "CreateCompletionResponse")])
@pytest.mark.parametrize("field", REQUIRED, ids=[".".join(map(str, f)) for f in REQUIRED])
def test_wire_body_missing_a_required_field_fails_validation(path, schema, field):
    """Proves the schema checks can fail: a real response and stream chunk, one required field deleted."""
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    body = {"messages": USER} if path == CHAT else {"prompt": "Hi"}
    full, chunks = _run(engine, path, body)
    chunk_schema = "CreateChatCompletionStreamResponse" if path == CHAT else COMPLETION_CHUNK
    chunk = chunks[1]  # a content chunk, finish_reason null
    validate(full, schema)
    validate(chunk, chunk_schema)
    with pytest.raises(jsonschema.ValidationError):
        validate(_without(full, field), schema)
    with pytest.raises(jsonschema.ValidationError):
        validate(_without(chunk, field), chunk_schema)


def test_sse_validation_reads_every_event_as_sent():
    async def scenario():
        async with app_client(FakeEngineClient(make_tokenizer(), "Hello world.")) as client:
            response = await client.post(CHAT, json={"messages": USER, "stream": True})
            return await response.read()

    lines = asyncio.run(scenario()).split(b"\n")
    chunks = validate_sse(lines, "CreateChatCompletionStreamResponse")
    assert _chat_text(chunks) == "Hello world."
    broken = [line.replace(b'"created":', b'"made":', 1) if i == 2 else line for i, line in enumerate(lines)]
    assert broken != lines
    with pytest.raises(jsonschema.ValidationError):
        validate_sse(broken, "CreateChatCompletionStreamResponse")
    with pytest.raises(AssertionError, match="DONE"):
        validate_sse([line for line in lines if line != b"data: [DONE]"], "CreateChatCompletionStreamResponse")


def test_completion_accepts_token_ids_and_defaults_to_16_tokens():
    engine = FakeEngineClient(make_tokenizer(), "x" * 40, reply_token_ids=list(range(3, 43)))
    full, _ = _run(engine, COMPLETIONS, {"prompt": [10, 11, 12]})  # model omitted: the served one
    assert engine.requests[0].prompt_token_ids == [10, 11, 12]
    assert engine.requests[0].sampling_params.max_tokens == 16
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_max_tokens_gives_length_and_chat_default_fills_the_context():
    engine = FakeEngineClient(make_tokenizer(), "Hello world. The capital of France is Paris.", max_model_len=128)
    full, chunks = _run(engine, CHAT, {"messages": USER, "max_completion_tokens": 3})
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 3
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

    _run(engine, CHAT, {"messages": USER})
    request = engine.requests[-1]
    assert request.sampling_params.max_tokens == 128 - len(request.prompt_token_ids)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_string_truncates_finishes_and_aborts(path):
    engine = FakeEngineClient(make_tokenizer(), "Hello world. The capital of France is Paris.")
    body = {"stop": ["capital", "zzz"], "max_tokens": 100}
    body.update({"messages": USER} if path == CHAT else {"prompt": "Hi"})
    full, chunks = _run(engine, path, body)
    choice = full["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert text == "Hello world. The "
    assert choice["finish_reason"] == "stop"
    streamed = _chat_text(chunks) if path == CHAT else "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == text
    # Both requests stopped early on the frontend's side: the engine was told to abort them.
    assert engine.aborted == [r.request_id for r in engine.requests]


def test_client_disconnect_mid_stream_aborts_the_request():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.01)
        async with app_client(engine) as client:
            response = await client.post(CHAT, json={"messages": USER, "stream": True})
            await response.content.readline()  # the role chunk
            await response.content.readline()
            response.close()  # drop the connection
            await wait_until(lambda: engine.aborted, "the request aborted")
            return engine, list(engine.aborted)  # before the test server shuts down

    engine, aborted = asyncio.run(scenario())
    assert aborted == [engine.requests[0].request_id]


def test_client_disconnect_while_waiting_for_a_full_response_aborts():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 200, step_delay_s=0.01)
        async with app_client(engine) as client:
            task = asyncio.create_task(client.post(CHAT, json={"messages": USER}))
            await wait_until(lambda: engine.requests, "the request reached the engine")
            task.cancel()
            await wait_until(lambda: engine.aborted, "the request aborted")
            return engine, list(engine.aborted)  # before the test server shuts down

    engine, aborted = asyncio.run(scenario())
    assert aborted == [engine.requests[0].request_id]


@pytest.mark.parametrize("how", ["raise", "error_output"])
def test_engine_failure_mid_stream_sends_one_error_event_then_done(how):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "Hello world. The capital")
        if how == "raise":
            engine.fail_after = 3
        else:
            engine.error_after = 3
        async with app_client(engine) as client:
            response = await client.post(CHAT, json={"messages": USER, "stream": True})
            assert response.status == 200
            return await read_sse(response)

    chunks, raw = asyncio.run(scenario())
    *content, error = chunks
    for chunk in content:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert _chat_text(content) == "Hello"  # "He", "ll", "o"
    validate(error, "ErrorResponse")
    assert error["error"]["code"] == ("service_unavailable" if how == "raise" else "internal_error")
    assert raw[-1] == b"data: [DONE]"


def test_models_health_and_version():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer())
        async with app_client(engine, max_model_len=100) as client:
            models = await (await client.get("/v1/models")).json()
            model = await (await client.get("/v1/models/fake-model")).json()
            health = (await client.get("/health")).status
            version = await (await client.get("/version")).json()
            engine.is_ready = False
            unhealthy = (await client.get("/health")).status
            return models, model, health, version, unhealthy

    models, model, health, version, unhealthy = asyncio.run(scenario())
    validate(models, "ListModelsResponse")
    validate(model, "Model")
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert model["max_model_len"] == 100  # the frontend's lower limit wins over the engine's 256
    assert health == 200 and unhealthy == 503
    assert version == {"version": metadata.version("spindle")}


def test_full_responses_ask_for_merged_outputs_unless_they_have_stop_strings():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")

    async def scenario():
        async with app_client(engine) as client:
            for body in ({"prompt": "Hi"}, {"prompt": "Hi", "stream": True}, {"prompt": "Hi", "stop": ["x"]}):
                resp = await client.post("/v1/completions", json={**body})
                assert resp.status == 200, await resp.text()

    asyncio.run(scenario())
    assert engine.final_only == [True, False, False]


def test_streamed_responses_ask_for_the_stream_interval_unless_they_have_stop_strings():
    """A stop string must reach the detokenizer at once (it aborts the request), so its request is
    handed every step's tokens; the others every --stream-interval tokens."""
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")

    async def scenario():
        async with app_client(engine, stream_interval=4) as client:
            for body in ({"prompt": "Hi", "stream": True}, {"prompt": "Hi", "stream": True, "stop": ["x"]},
                         {"prompt": "Hi"}):
                resp = await client.post("/v1/completions", json=body)
                assert resp.status == 200, await resp.text()
            resp = await client.post("/v1/chat/completions",
                                     json={"messages": [{"role": "user", "content": "Hi"}], "stream": True})
            assert resp.status == 200, await resp.text()

    asyncio.run(scenario())
    assert engine.stream_intervals == [4, 1, 4, 4]
    assert engine.final_only == [False, False, True, False]
