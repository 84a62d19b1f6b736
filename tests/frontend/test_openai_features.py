"""n choices, logprobs, echo, /tokenize and /detokenize against the scripted engine."""
from __future__ import annotations

import asyncio

import pytest

from services.frontend.errors import EngineError
from services.frontend.logprobs import TokenStrings
from tests.frontend.fakes import FakeEngineClient, app_client, fake_logprobs, make_tokenizer, read_sse
from tests.frontend.test_serving import MULTI_BYTE
from tests.openai_schema import COMPLETION_CHUNK, validate

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Say hello"}]


def _post(engine: FakeEngineClient, path: str, body: dict, stream: bool = False):
    async def scenario():
        async with app_client(engine) as client:
            response = await client.post(path, json=body)
            assert response.status == 200, await response.text()
            if stream:
                return (await read_sse(response))[0]
            return await response.json()

    return asyncio.run(scenario())


def test_n_choices_fan_out_with_ids_and_seeds_and_merge():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    full = _post(engine, CHAT, {"messages": USER, "n": 3, "seed": 41, "max_tokens": 50})
    validate(full, "CreateChatCompletionResponse")
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello world." and c["finish_reason"] == "stop" for c in full["choices"])
    ids = [r.request_id for r in engine.requests]
    assert ids == [f"{full['id']}-{i}" for i in range(3)]
    assert [r.sampling_params.seed for r in engine.requests] == [41, 42, 43]
    assert all(r.sampling_params.n == 1 for r in engine.requests)  # the engine only sees single choices
    per_choice = len(engine.reply_token_ids) + 1
    assert full["usage"]["completion_tokens"] == 3 * per_choice
    assert full["usage"]["prompt_tokens"] == len(engine.requests[0].prompt_token_ids)  # counted once


def test_n_choices_stream_interleaves_tagged_chunks():
    engine = FakeEngineClient(make_tokenizer(), MULTI_BYTE)
    chunks = _post(engine, COMPLETIONS, {"prompt": "Hi", "n": 2, "max_tokens": 100, "stream": True,
                                         "stream_options": {"include_usage": True}}, stream=True)
    for chunk in chunks[:-1]:
        validate(chunk, COMPLETION_CHUNK)
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {0: MULTI_BYTE, 1: MULTI_BYTE} and reasons == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * (len(engine.reply_token_ids) + 1)


def test_one_failing_choice_fails_the_request_and_aborts_the_others():
    engine = FakeEngineClient(make_tokenizer(), "word " * 50, step_delay_s=0.001)
    engine.fail_after = 3
    async def scenario():
        async with app_client(engine) as client:
            response = await client.post(CHAT, json={"messages": USER, "n": 2})
            return response.status, await response.json()

    status, payload = asyncio.run(scenario())
    assert status == 503
    validate(payload, "ErrorResponse")
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests)


def test_chat_logprobs_shape_and_bytes():
    engine = FakeEngineClient(make_tokenizer(), MULTI_BYTE)
    full = _post(engine, CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 3, "max_tokens": 100})
    validate(full, "CreateChatCompletionResponse")
    assert engine.requests[0].sampling_params.logprobs == 3
    content = full["choices"][0]["logprobs"]["content"]
    sampled = engine.reply_token_ids + [engine.tokenizer.eos_token_id]
    assert len(content) == len(sampled)
    strings = TokenStrings(engine.tokenizer)
    for entry, token_id in zip(content, sampled):
        assert (entry["token"], entry["logprob"]) == (strings.text(token_id), -0.25)
        # Chat lists exactly top_logprobs alternatives, best first, each with its bytes.
        assert entry["top_logprobs"] == [{"token": strings.text(t), "logprob": v, "bytes": list(strings.bytes(t))}
                                         for t, v in fake_logprobs(token_id, 3).top_logprobs]
    # The tokens' bytes (without EOS) add up to the text, though single tokens split characters.
    assert b"".join(bytes(e["bytes"]) for e in content[:-1]).decode() == MULTI_BYTE
    assert any("\ufffd" in e["token"] for e in content)

    chunks = _post(engine, CHAT, {"messages": USER, "logprobs": True, "max_tokens": 100, "stream": True},
                   stream=True)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert all(e["top_logprobs"] == [] for e in streamed)  # top_logprobs defaults to 0


def test_completion_logprobs_shape():
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    full = _post(engine, COMPLETIONS, {"prompt": "Hi", "logprobs": 2, "max_tokens": 100})
    validate(full, "CreateCompletionResponse")
    logprobs = full["choices"][0]["logprobs"]
    n = len(engine.reply_token_ids) + 1
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == n
    assert "".join(logprobs["tokens"][:-1]) == "Hello world."
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][1:] == [sum(map(len, logprobs["tokens"][:i])) for i in range(1, n)]
    # The fake samples each token at rank 1, so the sampled token is one of the 2 alternatives and
    # each position lists exactly those 2 (the k + 1 case is in tests/frontend/test_logprobs.py).
    strings = TokenStrings(engine.tokenizer)
    sampled = engine.reply_token_ids + [engine.tokenizer.eos_token_id]
    assert logprobs["top_logprobs"] == [{strings.text(t): v for t, v in fake_logprobs(token_id, 2).top_logprobs}
                                        for token_id in sampled]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert logprobs["token_logprobs"] == [-0.25] * n

    chunks = _post(engine, COMPLETIONS, {"prompt": "Hi", "logprobs": 2, "max_tokens": 100, "stream": True},
                   stream=True)
    for chunk in chunks:
        validate(chunk, COMPLETION_CHUNK)
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == logprobs["tokens"]
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == logprobs["text_offset"]


@pytest.mark.parametrize("prompt", ["Say hello", "PROMPT_IDS"])
def test_echo_puts_the_prompt_first(prompt):
    tokenizer = make_tokenizer()
    engine = FakeEngineClient(tokenizer, "Hello world.")
    if prompt == "PROMPT_IDS":
        prompt = tokenizer.encode("Say hello", add_special_tokens=False)
    full = _post(engine, COMPLETIONS, {"prompt": prompt, "echo": True, "max_tokens": 100})
    assert full["choices"][0]["text"] == "Say hello" + "Hello world."
    chunks = _post(engine, COMPLETIONS, {"prompt": prompt, "echo": True, "max_tokens": 100, "stream": True},
                   stream=True)
    assert chunks[0]["choices"][0]["text"].startswith("Say hello")
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_annotation_fields_are_accepted():
    engine = FakeEngineClient(make_tokenizer(), "Hi")
    body = {"messages": USER, "user": "u", "metadata": {"a": "b"}, "store": True, "service_tier": "auto",
            "safety_identifier": "s", "prompt_cache_key": "k", "parallel_tool_calls": False, "best_of": 1,
            "use_beam_search": False, "guided_json": None, "add_generation_prompt": True}
    assert _post(engine, CHAT, body)["choices"][0]["message"]["content"] == "Hi"


def test_tokenize_and_detokenize_round_trip():
    tokenizer = make_tokenizer()

    async def scenario():
        async with app_client(FakeEngineClient(tokenizer)) as client:
            body = {"prompt": MULTI_BYTE, "return_token_strs": True}
            plain = await (await client.post("/tokenize", json=body)).json()
            chat = await (await client.post("/tokenize", json={"messages": USER})).json()
            text = await (await client.post("/detokenize", json={"tokens": plain["tokens"]})).json()
            return plain, chat, text

    plain, chat, text = asyncio.run(scenario())
    assert plain["tokens"] == tokenizer.encode(MULTI_BYTE) and plain["count"] == len(plain["tokens"])
    assert plain["max_model_len"] == 256 and len(plain["token_strs"]) == plain["count"]
    assert chat["tokens"][-3:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    assert text == {"prompt": MULTI_BYTE}


def test_engine_refusal_of_one_choice_is_the_request_status():
    engine = FakeEngineClient(make_tokenizer())
    engine.refuse = EngineError("queue full", "resource_exhausted")

    async def scenario():
        async with app_client(engine) as client:
            response = await client.post(CHAT, json={"messages": USER, "n": 2, "stream": True})
            return response.status, dict(response.headers)

    status, headers = asyncio.run(scenario())
    assert status == 429 and headers["Retry-After"] == "1"
