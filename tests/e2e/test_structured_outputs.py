"""Structured outputs end to end on the embedded model, through the official `openai` client: the
constraint decides the text (the same greedy request without it writes something else), every body
and stream event validates against OpenAI's description, and a constraint that does not compile
fails alone while other requests run unchanged. Tool calling has its own module
(test_tool_calling.py); both share this cluster fixture's settings."""
from __future__ import annotations

import asyncio
import json
import re
from enum import Enum

import jsonschema
import openai
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from tests.e2e.cluster import module_cluster
from tests.e2e.openai_calls import openai_client
from tests.openai_schema import acreate, create, stream

CHAT_SCHEMA, CHUNK_SCHEMA, COMPLETION_SCHEMA = (
    "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse")


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)
    color: Color


class Owner(BaseModel):
    name: str = Field(max_length=16)
    pets: list[Pet] = Field(max_length=2)
    score: float = Field(ge=0, le=10)


class Answer(BaseModel):
    is_capital: bool
    city: str = Field(max_length=20)


SCHEMAS = [Pet, Owner, Answer]
PROMPT = [{"role": "user", "content": "Describe a pet owner and their pets as JSON."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def chat(client, **kwargs):
    kwargs.setdefault("model", "SmolLM2-135M-Instruct")
    kwargs.setdefault("messages", PROMPT)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 160)
    return create(client.chat.completions, CHAT_SCHEMA, **kwargs)


@pytest.mark.parametrize("model_cls", SCHEMAS, ids=[m.__name__ for m in SCHEMAS])
def test_parse_returns_objects_that_validate(client, model_cls):
    completion = client.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=PROMPT, temperature=0.0,
                                               max_tokens=200, response_format=model_cls)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model_cls)
    schema = type_to_response_format_param(model_cls)["json_schema"]["schema"]
    jsonschema.validate(json.loads(choice.message.content), schema)
    # The body as sent validates too (parse() does not expose it).
    raw = chat(client, response_format=type_to_response_format_param(model_cls), max_tokens=200)
    assert raw.choices[0].message.content == choice.message.content


@pytest.mark.parametrize("model_cls", [Owner], ids=["Owner"])
def test_streamed_json_schema_assembles_to_a_valid_object(client, model_cls):
    response_format = type_to_response_format_param(model_cls)
    chunks = stream(client.chat.completions, CHUNK_SCHEMA, model="SmolLM2-135M-Instruct", messages=PROMPT,
                    temperature=0.0, max_tokens=200, response_format=response_format)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    model_cls.model_validate_json(text)
    with client.chat.completions.stream(model="SmolLM2-135M-Instruct", messages=PROMPT, temperature=0.0,
                                        max_tokens=200, response_format=model_cls) as s:
        final = s.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, model_cls)
    assert final.choices[0].message.content == text


def test_the_constraint_acts_the_same_request_without_it_writes_free_text(client):
    free = chat(client).choices[0].message.content
    with pytest.raises(ValueError):
        Owner.model_validate_json(free)
    constrained = chat(client, response_format=type_to_response_format_param(Owner), max_tokens=200)
    Owner.model_validate_json(constrained.choices[0].message.content)
    assert constrained.choices[0].message.content != free


def test_json_object_regex_and_choice(client):
    record = [{"role": "user", "content": "Reply with a JSON object with keys name and age."}]
    text = chat(client, messages=record, response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(text), dict)
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    capital = [{"role": "user", "content": "Name a city and a year."}]
    free = chat(client, messages=capital, max_tokens=24).choices[0].message.content
    assert not re.fullmatch(pattern, free)
    text = chat(client, messages=capital, extra_body={"structured_outputs": {"regex": pattern}}).choices[0].message.content
    assert re.fullmatch(pattern, text), text
    options = ["yes", "no", "not sure"]
    answer = chat(client, messages=[{"role": "user", "content": "Is Paris the capital of France?"}],
                  extra_body={"structured_outputs": {"choice": options}}).choices[0]
    assert answer.message.content in options and answer.finish_reason == "stop"


def test_completions_take_the_same_constraints(client):
    out = create(client.completions, COMPLETION_SCHEMA, model="SmolLM2-135M-Instruct", prompt="The answer is",
                 temperature=0.0, max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{1,3}"}})
    assert re.fullmatch("[0-9]{1,3}", out.choices[0].text), out.choices[0].text
    out = create(client.completions, COMPLETION_SCHEMA, model="SmolLM2-135M-Instruct",
                 prompt="A JSON object with keys name and age:", temperature=0.0, max_tokens=64,
                 extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_n_choices_seeds_and_logprobs_under_a_schema(client):
    response_format = type_to_response_format_param(Pet)
    out = chat(client, n=3, temperature=1.0, seed=11, response_format=response_format, logprobs=True,
               top_logprobs=2, max_tokens=120)
    again = chat(client, n=3, temperature=1.0, seed=11, response_format=response_format, max_tokens=120)
    for choice, repeat in zip(out.choices, again.choices):
        Pet.model_validate_json(choice.message.content)
        assert repeat.message.content == choice.message.content  # a seed gives the same text
        tokens = choice.logprobs.content
        assert tokens[-1].token == "<|im_end|>"  # the EOS the grammar allowed once the object closed
        # Token strings may be byte fragments of one character (an emoji): their bytes join exactly.
        assert b"".join(bytes(t.bytes) for t in tokens[:-1]).decode() == choice.message.content
        assert all(t.logprob <= 0.0 and len(t.top_logprobs) == 2 for t in tokens)


def test_max_tokens_cuts_the_json_with_finish_reason_length(client):
    out = chat(client, response_format=type_to_response_format_param(Owner), max_tokens=6).choices[0]
    assert out.finish_reason == "length"
    assert out.message.content.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.message.content)


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=4, extra_body=body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_an_uncompilable_grammar_fails_alone_while_eight_requests_run_unchanged(cluster):
    aclient = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [[{"role": "user", "content": f"Count to {i + 3}."}] for i in range(8)]

    async def one(messages, **extra):
        out = await acreate(aclient.chat.completions, CHAT_SCHEMA, model="SmolLM2-135M-Instruct",
                            messages=messages, temperature=0.0, max_tokens=24, **extra)
        return out.choices[0].message.content

    async def alone():
        return await asyncio.gather(*(one(m) for m in prompts))

    async def beside_a_bad_grammar():
        bad = one(prompts[0], extra_body={"structured_outputs": {"grammar": "root ::= (unclosed"}})
        return await asyncio.gather(bad, *(one(m) for m in prompts), return_exceptions=True)

    async def both():  # one event loop for the one async client
        return await alone(), await beside_a_bad_grammar()

    expected, results = asyncio.run(both())
    assert isinstance(results[0], openai.BadRequestError) and results[0].body["param"] == "structured_outputs.grammar"
    assert results[1:] == expected
    idle = cluster.wait_for_idle()
    assert idle["num_free_blocks"] == idle["num_total_blocks"], idle


def test_the_public_grpc_api_takes_the_same_constraints(cluster):
    import grpc

    from services.common.pb import generate_pb2, generate_pb2_grpc

    params = generate_pb2.GenerateRequest.SamplingParams(temperature=0.0, max_tokens=8)
    with grpc.insecure_channel(cluster.frontend_grpc_addr) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        free = "".join(r.text for r in stub.Generate(generate_pb2.GenerateRequest(
            text="The answer is", sampling_params=params), timeout=120))
        responses = list(stub.Generate(generate_pb2.GenerateRequest(
            text="The answer is", sampling_params=params,
            structured_outputs=generate_pb2.StructuredOutputs(regex="[0-9]{1,3}")), timeout=120))
        text = "".join(r.text for r in responses)
        assert re.fullmatch("[0-9]{1,3}", text) and text != free
        assert responses[-1].finish_reason == generate_pb2.GenerateResponse.FINISH_REASON_STOP
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_pb2.GenerateRequest(
                text="x", structured_outputs=generate_pb2.StructuredOutputs(regex="a(b")), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.regex" in info.value.details()
