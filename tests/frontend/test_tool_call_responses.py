"""`tool_choice: auto` through the HTTP API against a scripted engine whose model writes a hermes
tool call: the full response carries `message.tool_calls` and the text around them, the stream's
`delta.tool_calls` pieces assemble to the same calls, and every body validates against OpenAI's
description. Without tools, or with `tool_choice: none`, the same text comes back as content."""
from __future__ import annotations

import asyncio
import json

from tests.frontend.fakes import FakeEngineClient, app_client, make_tokenizer, read_sse
from tests.openai_schema import validate

REPLY = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
         '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "tools": TOOLS}


def post(body: dict, stream: bool = False):
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), reply=REPLY, max_model_len=4096)
        async with app_client(engine) as client:
            response = await client.post("/v1/chat/completions", json={**body, "stream": stream})
            if stream:
                chunks, _ = await read_sse(response)
                return response.status, chunks, engine
            return response.status, await response.json(), engine

    return asyncio.run(scenario())


def test_auto_parses_the_hermes_calls_out_of_the_text():
    status, body, engine = post(BODY)
    assert status == 200, body
    validate(body, "CreateChatCompletionResponse")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me add. "
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "add", {"a": 1, "b": 2}), ("function", "add", {"a": 3, "b": 4})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert '"name": "add"' in prompt and "<tool_call>" in prompt  # the tools reached the template
    assert engine.requests[0].sampling_params.structured_outputs is None  # auto is not constrained


def test_the_stream_assembles_to_the_same_calls():
    status, chunks, _ = post(BODY, stream=True)
    assert status == 200
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        for piece in choice["delta"].get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"id": piece.get("id"), "name": piece["function"].get("name"),
                                                     "arguments": ""})
            assert (piece.get("id") is not None) == (call["arguments"] == "" and "id" in piece)
            call["arguments"] += piece["function"].get("arguments") or ""
        finish_reason = choice["finish_reason"] or finish_reason
    assert content == "Let me add. " and finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert "<tool_call>" not in content


def test_none_and_no_tools_leave_the_text_as_content():
    for body in ({**BODY, "tool_choice": "none"}, {k: v for k, v in BODY.items() if k != "tools"}):
        status, out, engine = post(body)
        assert status == 200
        assert out["choices"][0]["message"]["content"] == REPLY
        assert "tool_calls" not in out["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == "stop"
        assert "<tools>" not in engine.tokenizer.decode(engine.requests[0].prompt_token_ids)


def test_a_forced_choice_sends_the_schema_built_from_the_tools():
    _, _, engine = post({**BODY, "tool_choice": "required", "parallel_tool_calls": False})
    params = engine.requests[0].sampling_params.structured_outputs
    assert params.kind == "json"
    schema = json.loads(params.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "add"}
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    _, _, engine = post({**BODY, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert json.loads(engine.requests[0].sampling_params.structured_outputs.spec) == TOOLS[0]["function"]["parameters"]
