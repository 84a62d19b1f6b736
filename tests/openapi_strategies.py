"""Request bodies for the frontend's POST routes, drawn from the official OpenAI request schemas
(/work/shared/specs/openai-openapi.yaml, `nullable` already rewritten by tests/openai_schema.py),
and mutations of them that break the schema.

Three families per route, each a strategy of `Body` (the bytes sent, and how they were made):
- `official_bodies`: anything `CreateChatCompletionRequest` / `CreateCompletionRequest` accepts,
  with `model` narrowed to the served one (any other name is a 404 before anything else is read);
  every body is checked against the official schema. /tokenize and /detokenize have no OpenAI
  schema: theirs (vLLM's shape) is below, its chat messages the official ones.
- `served_bodies`: the official schema narrowed to what Spindle serves (text messages, a small
  `max_tokens`, few choices, vLLM's extra sampling fields), so that most bodies reach the engine.
- `mutated_bodies`: a served or official body broken one way: a field of the wrong type, a
  required field missing, a huge or non-finite number, odd unicode (lone surrogates included),
  unknown fields, deep nesting, or bytes that are not JSON at all.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from tests.json_schema_strategies import JSON_VALUES, flatten, from_schema
from tests.openai_schema import load_spec, validator

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
POST_ROUTES = (CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE)
OFFICIAL_SCHEMAS = {CHAT: "CreateChatCompletionRequest", COMPLETIONS: "CreateCompletionRequest"}
_REF = "#/components/schemas/"
# Stands for a raw JSON literal (a number Python would not write, deep nesting) until encoding.
_RAW = "\u2063raw\u2063"


@dataclass(frozen=True)
class Body:
    """One request body as sent, and how it was made (shown when a check fails)."""

    path: str
    raw: bytes
    kind: str

    def parsed(self) -> Any:
        """The body as the server's JSON parser sees it, or None where it is not JSON."""
        try:
            return json.loads(self.raw)
        except (ValueError, RecursionError):
            return None

    def __repr__(self) -> str:
        shown = self.raw if len(self.raw) <= 2000 else self.raw[:1000] + b"..." + self.raw[-200:]
        return f"Body({self.path}, {self.kind}, {len(self.raw)} bytes: {shown!r})"


def resolve(ref: str) -> dict[str, Any]:
    return load_spec()["components"]["schemas"][ref.removeprefix(_REF)]


def _is_officially_valid(path: str, body: Any) -> bool:
    return path not in OFFICIAL_SCHEMAS or validator(OFFICIAL_SCHEMAS[path]).is_valid(body)


# --- the schemas -----------------------------------------------------------------------------------
def _text_messages() -> dict[str, Any]:
    """Chat messages the frontend serves: roles the chat template knows (an assistant's never first),
    text content."""
    first, later = _text_message(["system", "developer", "user"]), _text_message(["system", "user", "assistant"])
    return {"maxItems": 3, "prefixItems": [first], "items": later}


def _text_message(roles: list[str]) -> dict[str, Any]:
    return {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"enum": roles},
        "content": {"anyOf": [{"type": "string"}, {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {"$ref": _REF + "ChatCompletionRequestMessageContentPartText"}}]},
        "name": {"type": "string"}}}


def _vllm_fields(vocab_size: int) -> dict[str, Any]:
    """vLLM's extra sampling fields, which the OpenAI schema does not have, in vLLM's ranges."""
    return {
        "top_k": {"type": "integer", "minimum": -1, "maximum": 50},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 2},
        "stop_token_ids": {"type": "array", "maxItems": 2,
                           "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}},
        "ignore_eos": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean"},
        "return_token_ids": {"type": "boolean"},
    }


def _narrowed(official: str, caps: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """The official schema's properties named in `caps`, each also bound by its cap; no others."""
    properties = flatten(resolve(_REF + official), resolve)["properties"]
    return {"type": "object", "required": required, "additionalProperties": False, "properties": {
        name: {"allOf": [properties[name], cap]} if name in properties else cap for name, cap in caps.items()}}


def _streamed_or_not(official: str, caps: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """`stream_options` only where `stream` is true (elsewhere it is refused, and would be most bodies)."""
    return {"anyOf": [_narrowed(official, {**caps, "stream": {"enum": [False]}}, required),
                      _narrowed(official, {**caps, "stream": {"const": True}, "stream_options": {}},
                                [*required, "stream"])]}


def _common_caps(model_name: str, vocab_size: int, max_tokens: int) -> dict[str, Any]:
    few_tokens = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    # Keys are token ids, which a schema cannot say of property names: name a few.
    bias = {"type": "object", "additionalProperties": False,
            "properties": {str(t): {"minimum": -100, "maximum": 100} for t in (0, 5, vocab_size - 1)}}
    return {"model": {"enum": [model_name]}, "max_tokens": few_tokens, "n": {"maximum": 3}, "stop": {},
            "temperature": {}, "top_p": {}, "seed": {}, "presence_penalty": {}, "frequency_penalty": {},
            "user": {}, "logit_bias": bias, **_vllm_fields(vocab_size)}


def served_schema(path: str, model_name: str, vocab_size: int, max_tokens: int) -> dict[str, Any]:
    caps = _common_caps(model_name, vocab_size, max_tokens)
    if path == CHAT:
        chat = {"messages": _text_messages(), "logprobs": {}, "top_logprobs": {"maximum": 5},
                "max_completion_tokens": caps["max_tokens"], "metadata": {}, "store": {}}
        return _streamed_or_not("CreateChatCompletionRequest", {**caps, **chat}, ["model", "messages", "max_tokens"])
    if path == COMPLETIONS:
        prompt = {"anyOf": [{"type": "string", "minLength": 1}, {
            "type": "array", "minItems": 1, "maxItems": 8,
            "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}]}
        completion = {"prompt": prompt, "echo": {}, "logprobs": {"maximum": 5}}
        return _streamed_or_not("CreateCompletionRequest", {**caps, **completion}, ["model", "prompt", "max_tokens"])
    return tokenization_schema(path, model_name, _text_messages(),
                               {"minimum": 0, "maximum": vocab_size - 1})


def official_schema(path: str, model_name: str) -> dict[str, Any]:
    if path in OFFICIAL_SCHEMAS:
        return {"allOf": [{"$ref": _REF + OFFICIAL_SCHEMAS[path]}, {"properties": {"model": {"enum": [model_name]}}}]}
    return tokenization_schema(path, model_name, {}, {})


def tokenization_schema(path: str, model_name: str, messages_cap: dict[str, Any],
                        token_cap: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /tokenize (a prompt, or chat messages) and /detokenize (token ids) bodies."""
    model = {"enum": [model_name]}
    if path == DETOKENIZE:
        return {"type": "object", "required": ["tokens"], "properties": {
            "model": model, "tokens": {"type": "array", "items": {"type": "integer", **token_cap}}}}
    flags = {"add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}
    messages = {"allOf": [{"type": "array", "minItems": 1, "items": {"$ref": _REF + "ChatCompletionRequestMessage"}},
                          messages_cap]}
    return {"anyOf": [
        {"type": "object", "required": ["prompt"],
         "properties": {"model": model, "prompt": {"type": "string"}, **flags}},
        {"type": "object", "required": ["messages"], "properties": {"model": model, "messages": messages, **flags}},
    ]}


# --- bodies ----------------------------------------------------------------------------------------
def _json_bytes(value: Any, raw: tuple[str, ...] = (), ensure_ascii: bool = True) -> bytes:
    """JSON text of `value`; each `_RAW` string is replaced by the next of `raw`, verbatim. Without
    `ensure_ascii` a lone surrogate is written as its (invalid) UTF-8 bytes, as a careless client would."""
    text = json.dumps(value, ensure_ascii=ensure_ascii)
    for literal in raw:
        text = text.replace(json.dumps(_RAW), literal, 1)
    return text.encode("utf-8", errors="surrogatepass")


@functools.lru_cache(maxsize=None)
def official_values(path: str, model_name: str) -> st.SearchStrategy[Any]:
    return from_schema(official_schema(path, model_name), resolve).filter(lambda b: _is_officially_valid(path, b))


@functools.lru_cache(maxsize=None)
def served_values(path: str, model_name: str, vocab_size: int, max_tokens: int) -> st.SearchStrategy[Any]:
    schema = served_schema(path, model_name, vocab_size, max_tokens)
    return from_schema(schema, resolve).filter(lambda b: _is_officially_valid(path, b))


def official_bodies(path: str, model_name: str) -> st.SearchStrategy[Body]:
    return official_values(path, model_name).map(lambda b: Body(path, _json_bytes(b), "official"))


def served_bodies(path: str, model_name: str, vocab_size: int, max_tokens: int) -> st.SearchStrategy[Body]:
    return served_values(path, model_name, vocab_size, max_tokens).map(lambda b: Body(path, _json_bytes(b), "served"))


# --- mutations ---------------------------------------------------------------------------------------
# Numbers JSON can spell but the usual ranges cannot hold: beyond int64 and float64, past the
# digits Python converts (4,300), non-finite (Python's parser reads NaN and Infinity), subnormal,
# negative zero, a float where an integer goes.
HUGE_NUMBERS = ("1" + "0" * 400, "9" * 5000, "-" + "9" * 30, str(2**63), str(2**64), "1e400", "-1e400", "1e308",
                "4.9e-324", "-0.0", "NaN", "Infinity", "-Infinity", "1.5", "1e2")
ODD_CHARACTERS = st.sampled_from([
    "\ud800", "\udfff", "\udc00\ud800",  # lone and reversed surrogates
    "\x00", "\ufeff", "\ufffd", "\uffff", "\U0010ffff", "\u202e", "\u200d", "\u0301", "\r\n", "\\", '"',
    "<|im_end|>", "<|im_start|>", "<|endoftext|>", "😀", "👍🏽", "🇫🇷", "日本語", "\U000e0001",
])
ODD_TEXT = st.lists(ODD_CHARACTERS | st.text(max_size=3), min_size=1, max_size=6).map("".join)
# Around the parser's own limit (about 1,000 levels) and a server's likely one (128), and anywhere.
DEPTHS = st.sampled_from([2, 127, 128, 129, 999, 1000, 1001, 5000, 10_000]) | st.integers(1, 20_000)
NOT_JSON = (b"", b" ", b"null", b"[]", b'"text"', b"12", b"{{{", b'{"a":1,"a":2}', b"\xff\xfe", b"\xc3\x28")
# (mutated body, raw literals for its `_RAW` strings, ensure_ascii), or the bytes to send.
Mutated = tuple[dict[str, Any], tuple[str, ...], bool] | bytes


def _wrong_type(draw: st.DrawFn, body: dict[str, Any], required: tuple[str, ...]) -> Mutated:
    key = draw(st.sampled_from(sorted(body) or ["messages"]))
    return {**body, key: draw(JSON_VALUES.filter(lambda v: type(v) is not type(body.get(key))))}, (), True


def _missing_field(draw: st.DrawFn, body: dict[str, Any], required: tuple[str, ...]) -> Mutated:
    present = [k for k in required if k in body] or sorted(body)
    drop = draw(st.sets(st.sampled_from(present), min_size=1)) if present else set()
    return {k: v for k, v in body.items() if k not in drop}, (), True


def _huge_number(draw: st.DrawFn, body: dict[str, Any], required: tuple[str, ...]) -> Mutated:
    numeric = sorted(k for k, v in body.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    key = draw(st.sampled_from(numeric + ["max_tokens", "n", "temperature", "seed", "top_k", "logprobs"]))
    return {**body, key: _RAW}, (draw(st.sampled_from(HUGE_NUMBERS)),), True


def _odd_unicode(draw: st.DrawFn, body: dict[str, Any], required: tuple[str, ...]) -> Mutated:
    """The first message's content, or a string field, or a new one, as odd text; sent escaped
    (`\\ud800`) or as raw (for a surrogate: invalid) UTF-8."""
    text = draw(ODD_TEXT)
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        mutated = {**body, "messages": [{**messages[0], "content": text}, *messages[1:]]}
    else:
        strings = sorted(k for k, v in body.items() if isinstance(v, str))
        mutated = {**body, draw(st.sampled_from(strings + ["prompt", "stop", "model", text])): text}
    return mutated, (), draw(st.booleans())


def _extra_fields(draw: st.DrawFn, body: dict[str, Any], required: tuple[str, ...]) -> Mutated:
    names = st.sampled_from(["messages", "prompt", "tokens", "stream", "n", "model", "__proto__", ""]) | st.text()
    return {**body, **draw(st.dictionaries(names, JSON_VALUES, min_size=1, max_size=3))}, (), True


def _deep_nesting(draw: st.DrawFn, body: dict[str, Any], required: tuple[str, ...]) -> Mutated:
    key = draw(st.sampled_from(sorted(body) + ["x"]))
    depth = draw(DEPTHS)
    open_, close = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    return {**body, key: _RAW}, (open_ * depth + "1" + close * depth,), True


def _not_json(draw: st.DrawFn, body: dict[str, Any], required: tuple[str, ...]) -> Mutated:
    """Cut short, wrapped in bytes that are not JSON or not UTF-8, or a value that is not an object."""
    text = _json_bytes(body)
    cut = text[:draw(st.integers(0, max(len(text) - 1, 0)))]
    return draw(st.sampled_from([cut, b"\xef\xbb\xbf" + text, text + b"\xff", b"\xc3\x28" + text,
                                 text.replace(b":", b"=", 1), text.replace(b"}", b",}", 1), *NOT_JSON]))


MUTATIONS = {"wrong type": _wrong_type, "missing field": _missing_field, "huge number": _huge_number,
             "odd unicode": _odd_unicode, "extra fields": _extra_fields, "deep nesting": _deep_nesting,
             "not json": _not_json}


@st.composite
def _mutate(draw: st.DrawFn, path: str, body: dict[str, Any], required: tuple[str, ...], how: str) -> Body:
    mutated = MUTATIONS[how](draw, body, required)
    raw = mutated if isinstance(mutated, bytes) else _json_bytes(*mutated)
    return Body(path, raw, f"mutated: {how}")


def mutated_bodies(path: str, model_name: str, vocab_size: int, max_tokens: int, how: str) -> st.SearchStrategy[Body]:
    """A served or official body broken one way (`how`, a key of MUTATIONS)."""
    required = tuple(flatten(official_schema(path, model_name), resolve).get("required", ()))
    if path == TOKENIZE:
        required = ("prompt", "messages")  # one of them
    values = served_values(path, model_name, vocab_size, max_tokens) | official_values(path, model_name)
    return values.filter(lambda b: isinstance(b, dict)).flatmap(lambda b: _mutate(path, b, required, how))
