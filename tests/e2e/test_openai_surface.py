"""The OpenAI surface end to end on the embedded default model, through the official `openai` client.

Each sampling knob is checked by an effect that would fail if the knob were ignored; logprobs are
checked against transformers' log-softmax; every bad-input row of docs/api.md is sent to the real
services. Every body and stream event is validated as it came over the wire. One cluster serves the
whole module.
"""
from __future__ import annotations

import collections
from importlib import metadata

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.model_files import resolve_model
from tests.e2e.cluster import module_cluster
from tests.e2e.openai_calls import (
    BLOCK_SIZE, EOS, chat_text, gather, get_json, openai_client, post_json, split_openai_args, template_ids,
)
from tests.e2e.parity import Reference, assert_greedy_match
from tests.frontend.bad_inputs import HTTP_CASES, doc_cases
from tests.openai_schema import COMPLETION_CHUNK, acreate, astream, create, stream, validate

CHAT_SCHEMA, CHUNK_SCHEMA, COMPLETION_SCHEMA = (
    "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse")

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time"
EMOJIS = [{"role": "user", "content": "Reply with three emojis."}]  # greedy: one emoji over and over
JAPANESE = [{"role": "user", "content": "Write the word 'cat' in Japanese."}]


@pytest.fixture(scope="module")
def model():
    return resolve_model(None, None)


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model.path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def completion(client, model, **kwargs):
    kwargs.setdefault("prompt", STORY)
    kwargs.setdefault("max_tokens", 12)
    return create(client.completions, COMPLETION_SCHEMA, model=model.name, **kwargs)


def chat(client, model, **kwargs):
    kwargs.setdefault("messages", CAPITAL)
    return create(client.chat.completions, CHAT_SCHEMA, model=model.name, **kwargs)


# --- sampling knobs ------------------------------------------------------------------------------
def _completion_call(model, prompt=STORY, max_tokens=8, **kwargs):
    """An AsyncOpenAI completions call for `gather`."""
    return lambda c: acreate(c.completions, COMPLETION_SCHEMA, model=model.name, prompt=prompt,
                             max_tokens=max_tokens, **split_openai_args(kwargs))


def _chat_call(model, messages=CAPITAL, **kwargs):
    """An AsyncOpenAI chat call for `gather`, with the prompt's and the choices' token ids."""
    kwargs.setdefault("return_token_ids", True)
    return lambda c: acreate(c.chat.completions, CHAT_SCHEMA, model=model.name, messages=messages,
                             **split_openai_args(kwargs))


def test_greedy_equivalents_at_high_temperature(cluster, model):
    """top_k=1, a tiny top_p and min_p=1 each leave only the top token: the greedy text at temperature 2."""
    greedy, *narrowed, free = gather(cluster, [
        _completion_call(model, temperature=0),
        _completion_call(model, temperature=2.0, seed=1, top_k=1),
        _completion_call(model, temperature=2.0, seed=2, top_p=1e-6),
        _completion_call(model, temperature=2.0, seed=3, min_p=1.0),
        _completion_call(model, temperature=2.0, seed=4),
    ])
    assert [r.choices[0].text for r in narrowed] == [greedy.choices[0].text] * 3
    assert free.choices[0].text != greedy.choices[0].text  # temperature 2 without the knobs wanders off


def test_seed_repeats_alone_and_inside_a_batch(cluster, model):
    (alone,) = gather(cluster, [_completion_call(model, temperature=1.5, seed=7)])
    # The same seed batched with other seeded and unseeded random requests gives the same text again.
    again, other_seed, *_ = gather(cluster, [
        _completion_call(model, temperature=1.5, seed=7),
        _completion_call(model, temperature=1.5, seed=8),
        _completion_call(model, temperature=1.5, prompt="The weather today"),
        _completion_call(model, temperature=1.5),
    ])
    assert again.choices[0].text == alone.choices[0].text
    assert other_seed.choices[0].text != alone.choices[0].text


def _repeats(token_ids: list[int]) -> int:
    return max(collections.Counter(token_ids).values())


def test_penalties_lower_the_repeats_of_a_token(cluster, model):
    base, *penalised = gather(cluster, [
        _chat_call(model, messages=EMOJIS, max_tokens=16, temperature=0, **penalty)
        for penalty in ({}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0})
    ])
    assert _repeats(base.choices[0].token_ids) >= 6, base.choices[0].message.content
    for name, response in zip(("frequency", "presence", "repetition"), penalised):
        assert _repeats(response.choices[0].token_ids) < _repeats(base.choices[0].token_ids), name


def test_logit_bias_forces_and_forbids_tokens(cluster, client, model, hf_model):
    forced_id = 17  # "!" in SmolLM2's vocabulary
    forced, greedy = gather(cluster, [_chat_call(model, max_tokens=8, logit_bias={str(forced_id): 100}),
                                      _chat_call(model, max_tokens=2, temperature=0)])
    assert forced.choices[0].token_ids == [forced_id] * 8
    with torch.inference_mode():
        best, runner_up = hf_model(torch.tensor([greedy.prompt_token_ids])).logits[0, -1].topk(2).indices.tolist()
    assert greedy.choices[0].token_ids[0] == best
    banned = chat(client, model, max_tokens=2, temperature=0, logit_bias={str(best): -100},
                  extra_body={"return_token_ids": True})
    assert banned.choices[0].token_ids[0] == runner_up


def hf_greedy_min_tokens(hf_model, prompt_token_ids: list[int], min_tokens: int, max_tokens: int) -> Reference:
    """Transformers' greedy output with EOS masked for the first `min_tokens` tokens."""
    input_ids = torch.tensor([prompt_token_ids])
    with torch.inference_mode():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                min_new_tokens=min_tokens, max_new_tokens=max_tokens, pad_token_id=EOS,
                                output_scores=True, return_dict_in_generate=True)
    return Reference(prompt_token_ids, out.sequences[0, len(prompt_token_ids):].tolist(),
                     [step[0].float() for step in out.scores], max_tokens)


def test_min_tokens_stop_token_ids_and_ignore_eos(cluster, model, hf_model):
    base, min_tokens, ignore_eos, stop_token = gather(cluster, [
        _chat_call(model, temperature=0, max_tokens=24),
        _chat_call(model, temperature=0, max_tokens=24, min_tokens=20),
        _chat_call(model, temperature=0, max_tokens=24, ignore_eos=True),
        _chat_call(model, temperature=0, max_tokens=24, stop_token_ids=[7042]),
    ])
    assert base.choices[0].finish_reason == "stop" and base.choices[0].token_ids[-1] == EOS
    assert base.usage.completion_tokens == len(base.choices[0].token_ids) < 20  # ends at EOS
    ours = min_tokens.choices[0].token_ids
    assert EOS not in ours[:20] and min_tokens.usage.completion_tokens == len(ours)
    assert_greedy_match(ours, hf_greedy_min_tokens(hf_model, min_tokens.prompt_token_ids, 20, 24), "min_tokens")
    assert ignore_eos.usage.completion_tokens == 24 and ignore_eos.choices[0].finish_reason == "length"
    # " Paris" (7042) ends the request where it appears; the token itself stays in the output.
    base_ids = base.choices[0].token_ids
    assert 7042 in base_ids
    assert stop_token.choices[0].token_ids == base_ids[:base_ids.index(7042) + 1]
    assert stop_token.choices[0].finish_reason == "stop"


def test_n_choices(cluster, client, model):
    seeded, greedy, single = gather(cluster, [
        _chat_call(model, n=3, temperature=1.0, seed=5, max_tokens=8),
        _completion_call(model, n=2, temperature=0),
        _completion_call(model, temperature=0),
    ])
    assert [c.index for c in seeded.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in seeded.choices}) == 3  # seed + i per choice
    assert greedy.choices[0].text == greedy.choices[1].text == single.choices[0].text
    assert greedy.usage.completion_tokens == 16 and greedy.usage.prompt_tokens == single.usage.prompt_tokens
    texts = collections.defaultdict(str)
    for chunk in stream(client.completions, COMPLETION_CHUNK, model=model.name, prompt=STORY, max_tokens=8, n=2,
                        temperature=0):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert dict(texts) == {0: single.choices[0].text, 1: single.choices[0].text}


# --- logprobs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(model):
    return AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()


def test_chat_logprobs_match_transformers(client, model, hf_model):
    resp = chat(client, model, max_tokens=10, temperature=0, logprobs=True, top_logprobs=5,
                extra_body={"return_token_ids": True})
    content = resp.choices[0].logprobs.content
    token_ids = resp.choices[0].token_ids
    assert len(content) == len(token_ids) == resp.usage.completion_tokens
    ids = torch.tensor([resp.prompt_token_ids + token_ids])
    with torch.inference_mode():
        reference = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
    num_prompt = len(resp.prompt_token_ids)
    for i, (entry, token_id) in enumerate(zip(content, token_ids)):
        expected = float(reference[num_prompt - 1 + i, token_id])
        assert abs(entry.logprob - expected) < 1e-4, (i, entry.logprob, expected)
        top = reference[num_prompt - 1 + i].topk(5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy picks the most likely token
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    # The tokens' bytes are the text, and EOS (if the reply ended on it) is spelled out.
    text_bytes = b"".join(bytes(e.bytes) for e in content)
    ending = "<|im_end|>" if token_ids[-1] == EOS else ""
    assert text_bytes.decode() == resp.choices[0].message.content + ending


def test_completion_logprobs_and_echo(cluster, model, hf_model):
    resp, echoed = gather(cluster, [_completion_call(model, logprobs=3, temperature=0, return_token_ids=True),
                                    _completion_call(model, echo=True, temperature=0)])
    logprobs = resp.choices[0].logprobs
    assert "".join(logprobs.tokens) == resp.choices[0].text
    ids = torch.tensor([resp.prompt_token_ids + resp.choices[0].token_ids])
    with torch.inference_mode():
        reference = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)[len(resp.prompt_token_ids) - 1:]
    for i, (token, lp, top) in enumerate(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)):
        assert lp == pytest.approx(float(reference[i].max()), abs=1e-4)  # greedy: the top token
        # Exactly 3: the sampled token is one of the top 3, so it adds no fourth entry.
        assert top[token] == lp and len(top) == 3
        assert sorted(top.values(), reverse=True) == pytest.approx(reference[i].topk(3).values.tolist(), abs=1e-4)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert echoed.choices[0].text == STORY + resp.choices[0].text


# --- text: UTF-8, stop strings, usage -------------------------------------------------------------
@pytest.mark.parametrize("messages", [EMOJIS, JAPANESE], ids=["emoji", "cjk"])
def test_multi_byte_text_streams_byte_identical(cluster, model, messages):
    def streamed(c):
        return astream(c.chat.completions, CHUNK_SCHEMA, model=model.name, messages=messages, max_tokens=10,
                       temperature=0)

    full, chunks = gather(cluster, [_chat_call(model, messages=messages, max_tokens=10, temperature=0), streamed])
    text = full.choices[0].message.content
    assert any(len(ch.encode()) > 2 for ch in text), text  # the model did write emoji / CJK
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert "".join(pieces).encode() == text.encode()
    assert not any("\ufffd" in p for p in pieces[:-1])


def test_stop_string_is_cut_and_the_request_aborted(cluster, client, model):
    steps_before = cluster.wait_for_idle()["num_steps"]
    # ignore_eos and 400 tokens: only the abort on the stop string ends this request early.
    full = chat(client, model, temperature=0, max_tokens=400, stop=["Paris", "zzz"], extra_body={"ignore_eos": True})
    assert full.choices[0].message.content == "The capital of France is "
    assert full.choices[0].finish_reason == "stop"
    stats = cluster.wait_for_idle()
    assert stats["num_steps"] - steps_before < 100, stats  # aborted after a few steps, not 400
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    chunks = stream(client.chat.completions, CHUNK_SCHEMA, model=model.name, messages=CAPITAL, temperature=0,
                    max_tokens=20, stop=" France")
    assert chat_text(chunks) == "The capital of"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    kept = chat(client, model, temperature=0, max_tokens=20, stop=["Paris"],
                extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "The capital of France is Paris"
    length = chat(client, model, temperature=0, max_tokens=3)
    assert length.choices[0].finish_reason == "length" and length.usage.completion_tokens == 3


def test_usage_everywhere_and_cached_tokens(client, model, tokenizer):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 8  # several KV blocks
    first = completion(client, model, prompt=long_prompt, max_tokens=2, temperature=0)
    second = completion(client, model, prompt=long_prompt, max_tokens=2, temperature=0)
    num_prompt = len(tokenizer.encode(long_prompt))
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (
        num_prompt, 2, num_prompt + 2)
    # Whole blocks from the prefix cache, short of the prompt's last token (which must be computed).
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    chunks = stream(client.chat.completions, CHUNK_SCHEMA, model=model.name, messages=CAPITAL, max_tokens=4,
                    temperature=0, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" not in c for c in chunks[:-1])  # optional: absent rather than null
    no_usage = stream(client.chat.completions, CHUNK_SCHEMA, model=model.name, messages=CAPITAL, max_tokens=2)
    assert all("usage" not in c and c["choices"] for c in no_usage)


# --- other endpoints and refusals ----------------------------------------------------------------
def test_tokenize_detokenize_version_health(cluster, model, tokenizer):
    status, tokens = post_json(cluster, "/tokenize", {"prompt": "Hello world"})
    assert status == 200
    expected = tokenizer.encode("Hello world")
    assert tokens == {"tokens": expected, "count": len(expected), "max_model_len": 2048}
    status, text = post_json(cluster, "/detokenize", {"tokens": tokens["tokens"]})
    assert (status, text) == (200, {"prompt": "Hello world"})
    status, chat_tokens = post_json(cluster, "/tokenize", {"model": model.name, "messages": CAPITAL})
    expected = template_ids(tokenizer, CAPITAL)
    assert status == 200 and (chat_tokens["tokens"], chat_tokens["count"]) == (expected, len(expected))
    assert get_json(cluster, "/version") == {"version": metadata.version("spindle")}
    assert get_json(cluster, "/health") == {"status": "ok"}


def test_annotation_fields_are_accepted(client, model):
    resp = chat(client, model, max_tokens=2, temperature=0, user="u-1", metadata={"team": "x"}, store=False)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 2


DOC_CASES = doc_cases()


@pytest.mark.parametrize("case", sorted(HTTP_CASES))
def test_documented_bad_inputs(cluster, case):
    path, body = HTTP_CASES[case]
    status, payload = post_json(cluster, path, body)
    expected = DOC_CASES[case]
    assert str(status) == expected.status, payload
    validate(payload, "ErrorResponse")
    assert (payload["error"]["param"], payload["error"]["code"]) == (expected.param, expected.code)


def test_server_still_serves_after_the_bad_inputs(cluster, client, model):
    assert chat(client, model, max_tokens=2, temperature=0).usage.completion_tokens == 2
    stats = cluster.wait_for_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
