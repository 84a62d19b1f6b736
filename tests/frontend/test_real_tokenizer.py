"""The frontend with the embedded default model's real tokenizer and chat template (fake engine)."""
from __future__ import annotations

import asyncio

import pytest

from services.common.model_files import eos_token_ids
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.chat_template import ChatTemplate
from services.frontend.tokenizer import load_tokenizer, render_chat_prompt
from tests.frontend.fakes import FakeEngineClient, read_sse
from tests.openai_schema import validate


@pytest.fixture(scope="module")
def model():
    from services.common.model_files import resolve_model

    return resolve_model(None, None)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(model.path)


def test_chat_template_and_eos(model, tokenizer):
    ids = render_chat_prompt(tokenizer, ChatTemplate.build(tokenizer, None), [{"role": "user", "content": "What is the capital of France?"}])
    # SmolLM2's template adds its default system turn and opens the assistant's.
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert len(ids) == 37
    assert eos_token_ids(model.path, tokenizer.eos_token_id) == (2,)  # <|im_end|>, also generation_config's


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "日本語 😀😀 👍🏽 café 中文", "a  b\n\n\tc"])
def test_detokenizer_matches_decode(tokenizer, text):
    prompt = render_chat_prompt(tokenizer, ChatTemplate.build(tokenizer, None), [{"role": "user", "content": "Hi"}])
    output = tokenizer.encode(text, add_special_tokens=False) + [2]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.update([t], is_finished=i == len(output) - 1) for i, t in enumerate(output)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_chat_through_the_app(model, tokenizer):
    from aiohttp.test_utils import TestClient, TestServer

    from services.frontend.app import create_app
    from services.frontend.serving_engine import ServingModel

    async def scenario():
        engine = FakeEngineClient(tokenizer, "Paris 🇫🇷 est la capitale.")
        serving = ServingModel(model.name, tokenizer, eos_token_ids(model.path, tokenizer.eos_token_id))
        async with TestClient(TestServer(create_app(engine, serving))) as client:
            body = {"model": model.name, "messages": [{"role": "user", "content": "Capital of France?"}]}
            full = await (await client.post("/v1/chat/completions", json=body)).json()
            chunks, _ = await read_sse(await client.post("/v1/chat/completions", json={**body, "stream": True}))
            return full, chunks

    full, chunks = asyncio.run(scenario())
    validate(full, "CreateChatCompletionResponse")
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Capital of France?"}],
                                             add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    reply_ids = tokenizer.encode("Paris 🇫🇷 est la capitale.", add_special_tokens=False)
    assert full["usage"] == {"prompt_tokens": len(expected), "completion_tokens": len(reply_ids) + 1,  # + EOS
                             "total_tokens": len(expected) + len(reply_ids) + 1,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == full["choices"][0]["message"]["content"] == "Paris 🇫🇷 est la capitale."


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_decode_matches_transformers_decode(tokenizer, skip_special_tokens):
    """The detokenizer's direct Rust decode gives transformers' text on every window it decodes:
    pieces of characters, special tokens, windows at the start of a text."""
    import random

    from services.frontend.detokenizer import decode_fn

    rng = random.Random(0)
    ids = tokenizer.encode("Paris 🇫🇷 est la capitale. 日本語 café  a\n\tb", add_special_tokens=False)
    ids = ids + [0, 1, 2] + ids  # <|endoftext|>, <|im_start|>, <|im_end|>
    decode = decode_fn(tokenizer)
    windows = [ids[i:j] for i in range(len(ids)) for j in range(i, min(i + 7, len(ids)) + 1)]
    windows += [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 6))] for _ in range(300)]
    for window in windows:
        assert decode(window, skip_special_tokens) == tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
