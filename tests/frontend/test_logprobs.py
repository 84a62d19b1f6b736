"""Token text and bytes for logprobs, and the OpenAI logprobs shapes."""
from __future__ import annotations

from services.common.messages import TokenLogprobs
from services.frontend.logprobs import MIN_LOGPROB, CompletionLogprobs, TokenStrings, chat_logprobs_content
from tests.frontend.fakes import make_tokenizer
from tests.openai_schema import validate


def test_byte_level_tokens_carry_their_exact_bytes():
    tokenizer = make_tokenizer()
    strings = TokenStrings(tokenizer)
    text = "emoji 😀😀 日本語 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(strings.bytes(i) for i in ids).decode() == text
    assert any(strings.text(i).endswith("\ufffd") for i in ids)  # some token splits a character
    eos = tokenizer.eos_token_id
    assert strings.bytes(eos) == b"<|im_end|>" and strings.text(eos) == "<|im_end|>"


class SentencePieceLike:
    """Just enough of a SentencePiece tokenizer with byte fallback (Llama 2, Mistral)."""

    PIECES = {0: "▁Hello", 1: "<0xF0>", 2: "<0x9F>", 3: "<0x98>", 4: "<0x80>", 5: "world"}
    added_tokens_decoder: dict = {}
    sp_model = None  # what slow SentencePiece tokenizers have

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.PIECES[token_id]

    def decode(self, token_ids, **_):
        raise AssertionError("not needed for these pieces")


def test_sentencepiece_pieces_and_byte_fallback():
    strings = TokenStrings(SentencePieceLike())
    assert b"".join(strings.bytes(i) for i in range(6)).decode() == " Hello😀world"
    assert strings.text(1) == "\ufffd"


def test_chat_and_completion_shapes_clamp_minus_infinity():
    strings = TokenStrings(make_tokenizer())
    ids = make_tokenizer().encode("Hello world", add_special_tokens=False)
    lps = [TokenLogprobs(logprob=-float("inf") if i == 0 else -0.5, rank=1, top_logprobs=[(t, -0.5), (t + 1, -2.0)])
           for i, t in enumerate(ids)]
    content = chat_logprobs_content(strings, ids, lps)
    assert content[0]["logprob"] == MIN_LOGPROB
    for entry in content:
        validate(entry, "ChatCompletionTokenLogprob")
    completion = CompletionLogprobs(strings, text_offset=5)
    first, second = completion.take(ids[:1], lps[:1]), completion.take(ids[1:], lps[1:])
    assert first["text_offset"] == [5]
    assert second["text_offset"][0] == 5 + len(first["tokens"][0])
    assert "".join(first["tokens"] + second["tokens"]) == "Hello world"
    assert all(token in top for token, top in zip(second["tokens"], second["top_logprobs"]))


def test_completion_top_logprobs_add_the_sampled_token_when_it_is_not_among_them():
    """With logprobs=k: k entries when the sampled token is one of the top k, else k + 1 (as vLLM and
    OpenAI's legacy completions do)."""
    tokenizer = make_tokenizer()
    strings = TokenStrings(tokenizer)
    hello, world, dot = tokenizer.encode("Hello world.", add_special_tokens=False)[:3]
    top = [(hello, -0.5), (world, -1.0)]
    in_top = TokenLogprobs(logprob=-1.0, rank=2, top_logprobs=top)
    outside = TokenLogprobs(logprob=-3.0, rank=7, top_logprobs=top)  # sampled at a high temperature
    out = CompletionLogprobs(strings).take([world, dot], [in_top, outside])
    assert out["top_logprobs"] == [
        {strings.text(hello): -0.5, strings.text(world): -1.0},
        {strings.text(hello): -0.5, strings.text(world): -1.0, strings.text(dot): -3.0},
    ]
    assert out["token_logprobs"] == [-1.0, -3.0]
