"""Logprobs in the OpenAI shapes, from the engine's `TokenLogprobs` (token ids and floats).

Chat: `choices[].logprobs.content[]` of `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
Completions: `choices[].logprobs` of `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`.

A byte-level tokenizer can split one character over several tokens, so a token's text alone may be
an invalid UTF-8 fragment: `bytes` carries the token's exact bytes (the field exists for this), and
`token` is those bytes decoded with U+FFFD for the broken parts, as vLLM does. Logprobs are the
model's, before temperature, penalties or bias (vLLM's default "raw" mode).
"""
from __future__ import annotations

import functools
import re
from typing import Any, Sequence

from services.common.messages import TokenLogprobs

# OpenAI's stand-in for "very unlikely": JSON has no -Infinity.
MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: printable bytes stand for themselves, the rest for 256+i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_kind(tokenizer: Any) -> str:
    """'byte_level' (GPT-2 style BPE), 'sentencepiece' (▁ for spaces, <0xNN> byte fallback) or 'other'."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = repr(backend.decoder) if backend is not None else ""
    if "ByteLevel" in decoder:
        return "byte_level"
    if "\u2581" in decoder or "Metaspace" in decoder or hasattr(tokenizer, "sp_model"):
        return "sentencepiece"
    return "other"


class TokenStrings:
    """The text and exact bytes of single tokens, cached per token id."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._kind = _decoder_kind(tokenizer)
        self._added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self._bytes = functools.lru_cache(maxsize=65536)(self._token_bytes)

    def bytes(self, token_id: int) -> bytes:
        return self._bytes(token_id)

    def text(self, token_id: int) -> str:
        return self._bytes(token_id).decode("utf-8", errors="replace")

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._added:  # added tokens are stored as plain text
            return piece.encode()
        if self._kind == "byte_level":
            decoder = _byte_level_decoder()
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
        elif self._kind == "sentencepiece":
            match = _BYTE_TOKEN.match(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("\u2581", " ").encode()  # the word-start marker is a space
        return self._tokenizer.decode([token_id]).encode()


def _clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def chat_logprobs_content(strings: TokenStrings, token_ids: Sequence[int],
                          logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries, one per sampled token."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": strings.text(token_id), "logprob": _clamp(logprob), "bytes": list(strings.bytes(token_id))}

    return [
        {**entry(token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top_logprobs]}
        for token_id, lp in zip(token_ids, logprobs)
    ]


class CompletionLogprobs:
    """Completions' logprobs object, grown token by token; `text_offset` counts characters of the text."""

    def __init__(self, strings: TokenStrings, text_offset: int = 0):
        self._strings = strings
        self._next_offset = text_offset

    def take(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The logprobs object for these tokens (the next part of the choice)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, logprobs):
            token = self._strings.text(token_id)
            # The sampled token is listed with the alternatives, as OpenAI and vLLM do.
            top = {self._strings.text(t): _clamp(v) for t, v in lp.top_logprobs}
            top.setdefault(token, _clamp(lp.logprob))
            out["tokens"].append(token)
            out["token_logprobs"].append(_clamp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._next_offset)
            self._next_offset += len(token)
        return out


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged
