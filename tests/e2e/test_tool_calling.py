"""Tool calling end to end on the embedded model, through the official `openai` client: forced
choices (a named function, `required`) return calls whose arguments validate against the tool's
schema, streamed pieces assemble to the same call, a conversation with the tool's result goes on,
and every body and stream event validates against OpenAI's description."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.cluster import module_cluster
from tests.e2e.openai_calls import TOOL_SCHEMAS, TOOLS, openai_client
from tests.openai_schema import create, stream

CHAT_SCHEMA, CHUNK_SCHEMA = "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def chat(client, **kwargs):
    kwargs.setdefault("model", "SmolLM2-135M-Instruct")
    kwargs.setdefault("messages", QUESTION)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("tools", TOOLS)
    return create(client.chat.completions, CHAT_SCHEMA, **kwargs)


def assembled_calls(chunks: list[dict]) -> tuple[list[dict], str | None, str]:
    """The calls that streamed `delta.tool_calls` pieces add up to, the finish reason and the content."""
    calls: dict[int, dict] = {}
    content, finish_reason = [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for piece in delta.get("tool_calls") or []:
                if piece["index"] not in calls:  # the first piece: index, id, type and name
                    assert piece["id"].startswith("call_") and piece["type"] == "function"
                    calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in piece and "name" not in piece.get("function", {})
                calls[piece["index"]]["arguments"] += piece["function"].get("arguments") or ""
            finish_reason = choice["finish_reason"] or finish_reason
    return [calls[i] for i in sorted(calls)], finish_reason, "".join(content)


def check_call(call_name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, TOOL_SCHEMAS[call_name])
    return args


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "add"}}, "required"],
                         ids=["named", "required"])
def test_forced_choices_return_valid_calls_and_the_stream_assembles_to_them(client, tool_choice):
    out = chat(client, tool_choice=tool_choice).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content is None
    calls = out.message.tool_calls
    assert len(calls) >= 1 and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    if tool_choice != "required":
        assert [c.function.name for c in calls] == ["add"]
    for call in calls:
        check_call(call.function.name, call.function.arguments)
    chunks = stream(client.chat.completions, CHUNK_SCHEMA, model="SmolLM2-135M-Instruct", messages=QUESTION,
                    temperature=0.0, max_tokens=120, tools=TOOLS, tool_choice=tool_choice)
    streamed, finish_reason, content = assembled_calls(chunks)
    assert finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]


def test_required_without_parallel_calls_makes_exactly_one(client):
    out = chat(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(out.message.tool_calls) == 1
    check_call(out.message.tool_calls[0].function.name, out.message.tool_calls[0].function.arguments)


def test_the_constraint_acts_without_tools_the_same_request_writes_text(client):
    free = chat(client, tools=None).choices[0].message
    assert free.tool_calls is None and free.content
    with pytest.raises(ValueError):
        json.loads(free.content)


def test_a_conversation_with_the_tools_result_continues(client):
    first = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    call = first.message.tool_calls[0]
    args = check_call("get_weather", call.function.arguments)
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": args["city"], "temperature": 21})},
    ]
    answer = chat(client, messages=messages, tool_choice="none").choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None and answer.message.content
    # The template rendered the call and its result: the prompt grew by both.
    plain = chat(client, messages=QUESTION, tool_choice="none", max_tokens=1)
    continued = chat(client, messages=messages, tool_choice="none", max_tokens=1)
    assert continued.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_auto_returns_text_when_the_model_calls_nothing(client):
    out = chat(client, tool_choice="auto").choices[0]
    assert out.finish_reason in ("stop", "length")
    if out.message.tool_calls is None:  # what the 135M model does here
        assert out.message.content
    else:
        for call in out.message.tool_calls:
            check_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "a", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "not json"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=4, **{k: v for k, v in body.items() if k in ("tools", "tool_choice", "messages")},
             extra_body={k: v for k, v in body.items() if k not in ("tools", "tool_choice", "messages")})
    assert info.value.body["param"] == param, info.value.body
