"""The bad-input table of docs/api.md, as runnable cases.

`doc_cases()` reads the table; `HTTP_CASES` / `GRPC_CASES` say how to send each case. Tests against
the scripted engine (tests/frontend) and against the real services (tests/e2e) run every row and
check the documented status, so the table and the behaviour cannot drift apart.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.pb import generate_pb2
from services.common.structured_outputs import MAX_SPEC_CHARS

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
USER = [{"role": "user", "content": "Hi"}]
# Bigger than the fake's and the default model's vocabulary, longer than either's context.
OUTSIDE_VOCAB = 99999
LONG_WORDS = "word " * 3000
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
BAD_REGEX = "a(b"
UNDEFINED_RULE_GRAMMAR = "root ::= missing_rule"


@dataclass(frozen=True)
class DocCase:
    case: str
    endpoint: str
    status: str  # "400", ..., or a gRPC status code name
    param: str | None
    code: str | None


def doc_cases() -> dict[str, DocCase]:
    text = DOC.read_text()
    table = text.split("<!-- bad-inputs:begin -->")[1].split("<!-- bad-inputs:end -->")[0]
    cases = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        case, endpoint, _what, status, param, code = cells
        case = case.strip("`")
        assert case not in cases, f"duplicate case {case} in {DOC}"
        none = ("–", "-", "")
        cases[case] = DocCase(case, endpoint, status, None if param in none else param, None if code in none else code)
    return cases


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello", **fields}


# case -> (path, body); a bytes body is sent as is.
HTTP_CASES: dict[str, tuple[str, Any]] = {
    "chat-invalid-json": (CHAT, b"{not json"),
    "chat-body-not-object": (CHAT, b"[1, 2]"),
    "chat-no-messages": (CHAT, {"max_tokens": 3}),
    "chat-empty-messages": (CHAT, chat(messages=[])),
    "chat-messages-not-array": (CHAT, chat(messages="hi")),
    "chat-message-not-object": (CHAT, chat(messages=["hi"])),
    "chat-no-role": (CHAT, chat(messages=[{"content": "hi"}])),
    "chat-unknown-role": (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}])),
    "chat-no-content": (CHAT, chat(messages=[{"role": "user"}])),
    "chat-content-number": (CHAT, chat(messages=[{"role": "user", "content": 5}])),
    "chat-image-part": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])),
    "chat-max-tokens-zero": (CHAT, chat(max_tokens=0)),
    "chat-max-tokens-negative": (CHAT, chat(max_tokens=-5)),
    "chat-max-tokens-string": (CHAT, chat(max_tokens="ten")),
    "chat-max-tokens-float": (CHAT, chat(max_tokens=1.5)),
    "chat-max-completion-tokens-zero": (CHAT, chat(max_completion_tokens=0)),
    "chat-max-tokens-too-long": (CHAT, chat(max_tokens=10_000)),
    "chat-prompt-too-long": (CHAT, chat(messages=[{"role": "user", "content": LONG_WORDS}])),
    "chat-temperature-high": (CHAT, chat(temperature=2.5)),
    "chat-temperature-negative": (CHAT, chat(temperature=-0.1)),
    "chat-temperature-string": (CHAT, chat(temperature="hot")),
    "chat-top-p-zero": (CHAT, chat(top_p=0)),
    "chat-top-p-high": (CHAT, chat(top_p=1.5)),
    "chat-top-k-negative": (CHAT, chat(top_k=-2)),
    "chat-min-p-high": (CHAT, chat(min_p=2)),
    "chat-presence-penalty-high": (CHAT, chat(presence_penalty=3)),
    "chat-frequency-penalty-low": (CHAT, chat(frequency_penalty=-3)),
    "chat-repetition-penalty-zero": (CHAT, chat(repetition_penalty=0)),
    "chat-seed-string": (CHAT, chat(seed="x")),
    "chat-seed-too-big": (CHAT, chat(seed=2**64)),
    "chat-n-zero": (CHAT, chat(n=0)),
    "chat-n-too-big": (CHAT, chat(n=129)),
    "chat-stream-string": (CHAT, chat(stream="yes")),
    "chat-stream-options-without-stream": (CHAT, chat(stream_options={"include_usage": True})),
    "chat-include-usage-string": (CHAT, chat(stream=True, stream_options={"include_usage": "yes"})),
    "chat-continuous-usage": (CHAT, chat(stream=True, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": True})),
    "chat-stop-empty": (CHAT, chat(stop=[""])),
    "chat-stop-number": (CHAT, chat(stop=5)),
    "chat-logit-bias-key": (CHAT, chat(logit_bias={"abc": 1})),
    "chat-logit-bias-range": (CHAT, chat(logit_bias={"5": 200})),
    "chat-logit-bias-vocab": (CHAT, chat(logit_bias={str(OUTSIDE_VOCAB): 1})),
    "chat-stop-token-ids-vocab": (CHAT, chat(stop_token_ids=[OUTSIDE_VOCAB])),
    "chat-min-tokens-over-max": (CHAT, chat(min_tokens=50, max_tokens=10)),
    "chat-logprobs-string": (CHAT, chat(logprobs="yes")),
    "chat-top-logprobs-high": (CHAT, chat(logprobs=True, top_logprobs=21)),
    "chat-top-logprobs-without-logprobs": (CHAT, chat(top_logprobs=3)),
    "chat-functions": (CHAT, chat(functions=[{"name": "f"}])),
    "chat-response-format-and-structured-outputs": (CHAT, chat(response_format={"type": "json_object"},
                                                                structured_outputs={"regex": "a+"})),
    "chat-two-structured-outputs": (CHAT, chat(structured_outputs={"regex": "a+", "choice": ["a"]})),
    "chat-regex-invalid": (CHAT, chat(structured_outputs={"regex": BAD_REGEX})),
    "chat-grammar-not-compiling": (CHAT, chat(structured_outputs={"grammar": UNDEFINED_RULE_GRAMMAR})),
    "chat-json-schema-invalid": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 3}}})),
    "chat-json-schema-no-name": (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}})),
    "chat-response-format-unknown-type": (CHAT, chat(response_format={"type": "xml"})),
    "chat-choice-empty": (CHAT, chat(structured_outputs={"choice": []})),
    "chat-structured-outputs-unknown-field": (CHAT, chat(structured_outputs={"pattern": "a+"})),
    "chat-whitespace-pattern": (CHAT, chat(structured_outputs={"json": {"type": "object"},
                                                               "whitespace_pattern": " "})),
    "chat-constraint-too-long": (CHAT, chat(structured_outputs={"regex": "a" * (MAX_SPEC_CHARS + 1)})),
    "chat-tool-choice-unknown-function": (CHAT, chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "nope"}})),
    "chat-tool-choice-without-tools": (CHAT, chat(tool_choice="required")),
    "chat-tool-choice-with-response-format": (CHAT, chat(tools=TOOLS, tool_choice="required",
                                                         response_format={"type": "json_object"})),
    "chat-tool-bad-name": (CHAT, chat(tools=[{"type": "function", "function": {"name": "bad name!"}}])),
    "chat-tool-not-function": (CHAT, chat(tools=[{"type": "retrieval"}])),
    "chat-parallel-tool-calls-string": (CHAT, chat(parallel_tool_calls="yes")),
    "chat-tool-message-without-id": (CHAT, chat(messages=[*USER, {"role": "tool", "content": "42"}])),
    "chat-user-tool-calls": (CHAT, chat(messages=[{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}])),
    "chat-tool-arguments-not-json": (CHAT, chat(tools=TOOLS, messages=[*USER, {"role": "assistant", "content": None,
                                                "tool_calls": [{"id": "c", "type": "function", "function": {
                                                    "name": "add", "arguments": "not json"}}]}])),
    "chat-modalities-audio": (CHAT, chat(modalities=["text", "audio"])),
    "chat-audio": (CHAT, chat(audio={"voice": "alloy", "format": "wav"})),
    "chat-reasoning-effort": (CHAT, chat(reasoning_effort="high")),
    "chat-guided-json": (CHAT, chat(guided_json={"type": "object"})),
    "chat-chat-template": (CHAT, chat(chat_template="{{ messages }}")),
    "chat-no-generation-prompt": (CHAT, chat(add_generation_prompt=False)),
    "chat-best-of": (CHAT, chat(best_of=3)),
    "chat-unknown-model": (CHAT, chat(model="gpt-4o")),
    "chat-model-number": (CHAT, chat(model=7)),
    "completions-no-prompt": (COMPLETIONS, {"max_tokens": 3}),
    "completions-empty-prompt": (COMPLETIONS, completion(prompt="")),
    "completions-empty-token-list": (COMPLETIONS, completion(prompt=[])),
    "completions-prompt-batch": (COMPLETIONS, completion(prompt=["a", "b"])),
    "completions-token-batch": (COMPLETIONS, completion(prompt=[[1, 2], [3]])),
    "completions-negative-token": (COMPLETIONS, completion(prompt=[-1])),
    "completions-token-outside-vocab": (COMPLETIONS, completion(prompt=[OUTSIDE_VOCAB])),
    "completions-prompt-too-long": (COMPLETIONS, completion(prompt=[5] * 3000)),
    "completions-max-tokens-zero": (COMPLETIONS, completion(max_tokens=0)),
    "completions-n-zero": (COMPLETIONS, completion(n=0)),
    "completions-best-of": (COMPLETIONS, completion(best_of=2)),
    "completions-logprobs-high": (COMPLETIONS, completion(logprobs=21)),
    "completions-logprobs-bool": (COMPLETIONS, completion(logprobs=True)),
    "completions-echo-with-logprobs": (COMPLETIONS, completion(echo=True, logprobs=1)),
    "completions-echo-string": (COMPLETIONS, completion(echo="yes")),
    "completions-suffix": (COMPLETIONS, completion(suffix="!")),
    "completions-regex-invalid": (COMPLETIONS, completion(structured_outputs={"regex": BAD_REGEX})),
    "completions-response-format-unknown-type": (COMPLETIONS, completion(response_format={"type": "xml"})),
    "completions-use-beam-search": (COMPLETIONS, completion(use_beam_search=True)),
    "completions-temperature-high": (COMPLETIONS, completion(temperature=9)),
    "completions-unknown-model": (COMPLETIONS, completion(model="nope")),
    "tokenize-no-prompt": (TOKENIZE, {"add_special_tokens": True}),
    "tokenize-bad-messages": (TOKENIZE, {"messages": []}),
    "tokenize-unknown-model": (TOKENIZE, {"model": "nope", "prompt": "hi"}),
    "detokenize-not-ids": (DETOKENIZE, {"tokens": ["a"]}),
    "detokenize-outside-vocab": (DETOKENIZE, {"tokens": [OUTSIDE_VOCAB]}),
}


def _generate(**fields: Any) -> generate_pb2.GenerateRequest:
    params = fields.pop("params", {})
    return generate_pb2.GenerateRequest(sampling_params=generate_pb2.GenerateRequest.SamplingParams(**params), **fields)


_SO = generate_pb2.StructuredOutputs

# case -> (RPC name, request)
GRPC_CASES: dict[str, tuple[str, Any]] = {
    "grpc-no-input": ("Generate", generate_pb2.GenerateRequest()),
    "grpc-empty-text": ("Generate", _generate(text="")),
    "grpc-temperature-high": ("Generate", _generate(text="x", params={"temperature": 3.0})),
    "grpc-max-tokens-negative": ("Generate", _generate(text="x", params={"max_tokens": -1})),
    "grpc-max-tokens-too-long": ("Generate", _generate(text="x", params={"max_tokens": 10_000})),
    "grpc-n-too-big": ("Generate", _generate(text="x", params={"n": 129})),
    "grpc-logprobs-high": ("Generate", _generate(text="x", params={"logprobs": 21})),
    "grpc-prompt-logprobs": ("Generate", _generate(text="x", params={"prompt_logprobs": 1})),
    "grpc-stop-empty": ("Generate", _generate(text="x", stop=[""])),
    "grpc-token-outside-vocab": ("Generate", _generate(
        token_ids=generate_pb2.GenerateRequest.TokenIds(token_ids=[10**6]))),
    "grpc-unknown-model": ("Generate", _generate(text="x", model="other")),
    "grpc-structured-outputs-empty": ("Generate", _generate(text="x", structured_outputs=_SO())),
    "grpc-regex-invalid": ("Generate", _generate(text="x", structured_outputs=_SO(regex=BAD_REGEX))),
    "grpc-grammar-not-compiling": ("Generate", _generate(
        text="x", structured_outputs=_SO(grammar=UNDEFINED_RULE_GRAMMAR))),
    "grpc-json-schema-invalid": ("Generate", _generate(text="x", structured_outputs=_SO(json='{"type": 3}'))),
    "grpc-json-not-json": ("Generate", _generate(text="x", structured_outputs=_SO(json="{not json"))),
    "grpc-choice-empty": ("Generate", _generate(text="x", structured_outputs=_SO(choice=_SO.Choices()))),
    "grpc-tokenize-unknown-model": ("Tokenize", generate_pb2.TokenizeRequest(text="x", model="other")),
    "grpc-abort-unknown-id": ("Abort", generate_pb2.AbortRequest(request_id="no-such-request")),
}


def param_of_grpc_details(details: str) -> str | None:
    match = re.search(r"\(param: ([^)]+)\)$", details or "")
    return match.group(1) if match else None
