"""Validates OpenAI request bodies (chat and completions) into typed requests.

Every refusal is a 400 `invalid_request_error` whose `param` names the offending field. Output
constraints are read by structured_outputs.py, tools by tool_choice.py. Fields that would change
the result but are not implemented (see unsupported.py) are refused rather than silently ignored; fields that only annotate a request (`user`, `metadata`,
`store`, ...) and unknown fields are accepted. vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `priority`, ...) are accepted at
the top level.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from services.common.messages import SamplingParams
from services.common.sampling_limits import MAX_LOGPROBS, MAX_N, sampling_params_violation
from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.errors import invalid_request
from services.frontend.structured_outputs import parse_constraint
from services.frontend.tool_choice import ToolChoice, parse_tool_choice
from services.frontend.unsupported import refuse_unsupported_chat_fields, refuse_unsupported_completion_fields

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class GenerationOptions:
    """What chat and completion requests share, after validation.

    `sampling_params.max_tokens` is a placeholder until the prompt length is known; `max_tokens` is
    what the client asked for (None: as many as fit).
    """

    model: str | None
    sampling_params: SamplingParams
    max_tokens: int | None
    max_tokens_param: str  # the field `max_tokens` came from, for error messages
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    is_stream: bool = False
    include_usage: bool = False
    priority: int = 0
    # vLLM's extension: add the prompt and output token ids to a non-streamed response.
    return_token_ids: bool = False
    # Completions only: the prompt text comes first in each choice's text.
    echo: bool = False
    # The field the output constraint (sampling_params.structured_outputs) came from, for errors.
    constraint_param: str = ""

    @property
    def n(self) -> int:
        return self.sampling_params.n


@dataclass(frozen=True)
class ChatCompletionRequest:
    # Role and plain-text content (assistant tool_calls, a tool message's tool_call_id), as sent.
    messages: list[dict[str, Any]]
    options: GenerationOptions
    tool_choice: ToolChoice | None = None  # None: the request has no tools


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    options: GenerationOptions


def parse_chat_request(body: dict[str, Any], defaults: Mapping[str, float] | None = None) -> ChatCompletionRequest:
    """`defaults`: the model's sampling defaults for unset fields (generation_defaults.py)."""
    refuse_unsupported_chat_fields(body)
    messages = _parse_messages(body.get("messages"))
    tool_choice = parse_tool_choice(body)
    forced = tool_choice.forced_constraint() if tool_choice is not None and tool_choice.is_forced else None
    return ChatCompletionRequest(messages=messages, options=_parse_options(body, True, defaults or {}, forced),
                                 tool_choice=tool_choice)


def parse_completion_request(body: dict[str, Any], defaults: Mapping[str, float] | None = None) -> CompletionRequest:
    refuse_unsupported_completion_fields(body)
    return CompletionRequest(prompt=_parse_prompt(body.get("prompt")), options=_parse_options(body, False, defaults or {}))


def check_sampling_params(p: SamplingParams) -> None:
    """Range checks shared by the HTTP and gRPC faces (max_tokens is checked against the prompt later);
    the ranges are the engine's too (services/common/sampling_limits.py)."""
    _check(1 <= p.n <= MAX_N, "n", f"n must be in [1, {MAX_N}].")
    violation = sampling_params_violation(p)
    if violation is not None:
        param, message = violation
        raise invalid_request(message, param=param)


# --- messages and prompts ------------------------------------------------------------------------
def _parse_messages(messages: Any) -> list[dict[str, Any]]:
    _check(messages is not None, "messages", "Missing required parameter: 'messages'.")
    _check(isinstance(messages, list), "messages", "'messages' must be an array.")
    _check(len(messages) > 0, "messages", "'messages' must contain at least one message.")
    return [_parse_message(i, message) for i, message in enumerate(messages)]


def _parse_message(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    _check(isinstance(message, dict), where, f"'{where}' must be an object.")
    role = message.get("role")
    _check(isinstance(role, str), f"{where}.role", f"Missing or invalid '{where}.role'.")
    _check(role in CHAT_ROLES, f"{where}.role",
           f"Invalid role {role!r} in '{where}.role'; supported: {', '.join(sorted(CHAT_ROLES))}.")
    tool_calls = message.get("tool_calls")
    _check(not tool_calls or role == "assistant", f"{where}.tool_calls", "Only assistant messages carry tool_calls.")
    content = message.get("content")
    if content is None:
        _check(role == "assistant", f"{where}.content", f"Missing '{where}.content'.")
        content = ""
    elif isinstance(content, list):
        content = _join_text_parts(where, content)
    else:
        _check(isinstance(content, str), f"{where}.content", f"'{where}.content' must be a string or array.")
    # Chat templates know "system"; "developer" is its newer name.
    parsed: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if tool_calls:
        parsed["tool_calls"] = _parse_tool_calls(where, tool_calls)
    if role == "tool":
        call_id = message.get("tool_call_id")
        _check(isinstance(call_id, str) and call_id, f"{where}.tool_call_id", f"Missing '{where}.tool_call_id'.")
        parsed["tool_call_id"] = call_id
    return parsed


def _parse_tool_calls(where: str, tool_calls: Any) -> list[dict[str, Any]]:
    _check(isinstance(tool_calls, list), f"{where}.tool_calls", f"'{where}.tool_calls' must be an array.")
    calls = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        _check(isinstance(call, dict) and isinstance(call.get("function"), dict), at,
               f"'{at}' must be an object with 'function'.")
        function = call["function"]
        _check(isinstance(function.get("name"), str) and function["name"], f"{at}.function.name",
               f"Missing '{at}.function.name'.")
        _check(isinstance(function.get("arguments"), str), f"{at}.function.arguments",
               f"'{at}.function.arguments' must be a JSON string.")
        calls.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    return calls


def _join_text_parts(where: str, parts: list[Any]) -> str:
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}.content[{j}]"
        _check(isinstance(part, dict), at, f"'{at}' must be an object.")
        _check(part.get("type") == "text", f"{at}.type", f"Content part type {part.get('type')!r} is not supported.")
        _check(isinstance(part.get("text"), str), f"{at}.text", f"'{at}.text' must be a string.")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_prompt(prompt: Any) -> str | list[int]:
    _check(prompt is not None, "prompt", "Missing required parameter: 'prompt'.")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check(prompt != "", "prompt", "'prompt' must not be empty.")
        return prompt
    _check(isinstance(prompt, list) and prompt, "prompt",
           "'prompt' must be a non-empty string or array of token ids (batches are not supported).")
    _check(all(_is_int(t) and t >= 0 for t in prompt), "prompt",
           "'prompt' must be a string or an array of non-negative token ids (batches are not supported).")
    return list(prompt)


# --- sampling options ----------------------------------------------------------------------------
def _parse_options(body: dict[str, Any], is_chat: bool, defaults: Mapping[str, float],
                   forced_tools: StructuredOutputsParams | None = None) -> GenerationOptions:
    model = body.get("model")
    _check(model is None or isinstance(model, str), "model", "'model' must be a string.")
    n = _integer(body, "n", 1)
    best_of = _integer(body, "best_of", None)
    _check(best_of is None or best_of == n, "best_of", "best_of must equal n (ranking choices is not supported).")

    max_tokens_param = "max_tokens"
    max_tokens = _integer(body, "max_tokens", None)
    if is_chat and body.get("max_completion_tokens") is not None:
        max_tokens_param, max_tokens = "max_completion_tokens", _integer(body, "max_completion_tokens", None)
    _check(max_tokens is None or max_tokens > 0, max_tokens_param, f"'{max_tokens_param}' must be at least 1.")

    top_k = _integer(body, "top_k", int(defaults.get("top_k", 0)))
    stop = _parse_stop(body.get("stop"))
    is_stream = _boolean(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        _check(is_stream, "stream_options", "'stream_options' is only allowed when 'stream' is true.")
        _check(isinstance(stream_options, dict), "stream_options", "'stream_options' must be an object.")
        include_usage = _boolean(stream_options, "include_usage", False, prefix="stream_options.")
        _check(not stream_options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats",
               "Usage in every chunk (vLLM's continuous_usage_stats) is not supported.")
    logprobs = _parse_chat_logprobs(body) if is_chat else _integer(body, "logprobs", None)
    echo = False if is_chat else _boolean(body, "echo", False)
    # With echo, logprobs would cover the prompt too, which needs prompt logprobs from the engine.
    _check(not (echo and logprobs is not None), "echo", "echo together with logprobs is not supported yet.")
    constraint = parse_constraint(body)
    if forced_tools is not None:
        _check(constraint is None, "tool_choice",
               "A forced tool_choice ('required' or a named function) constrains the output already; "
               "drop 'response_format' / 'structured_outputs'.")
        constraint = (forced_tools, "tools")

    params = SamplingParams(
        n=n,
        temperature=_number(body, "temperature", defaults.get("temperature", 1.0)),
        top_p=_number(body, "top_p", defaults.get("top_p", 1.0)),
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
        min_p=_number(body, "min_p", defaults.get("min_p", 0.0)),
        seed=_integer(body, "seed", None),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0)),
        logit_bias=_parse_logit_bias(body.get("logit_bias")),
        max_tokens=max_tokens or 1,
        min_tokens=_integer(body, "min_tokens", 0),
        stop_token_ids=tuple(_token_ids(body, "stop_token_ids")),
        ignore_eos=_boolean(body, "ignore_eos", False),
        logprobs=logprobs,
        structured_outputs=constraint[0] if constraint is not None else None,
    )
    check_sampling_params(params)
    return GenerationOptions(
        model=model,
        sampling_params=params,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        stop=stop,
        include_stop_str_in_output=_boolean(body, "include_stop_str_in_output", False),
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
        is_stream=is_stream,
        include_usage=include_usage,
        priority=_integer(body, "priority", 0),
        return_token_ids=_boolean(body, "return_token_ids", False),
        echo=echo,
        constraint_param=constraint[1] if constraint is not None else "",
    )


def _parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat spells it `logprobs: true` plus `top_logprobs: k`; the engine wants k (None: no logprobs)."""
    wanted = _boolean(body, "logprobs", False)
    top_logprobs = _integer(body, "top_logprobs", None)
    _check(top_logprobs is None or 0 <= top_logprobs <= MAX_LOGPROBS, "top_logprobs",
           f"top_logprobs must be in [0, {MAX_LOGPROBS}].")
    _check(wanted or not top_logprobs, "top_logprobs", "top_logprobs needs 'logprobs': true.")
    return (top_logprobs or 0) if wanted else None


def _parse_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    _check(isinstance(stops, list) and all(isinstance(s, str) for s in stops), "stop",
           "'stop' must be a string or an array of strings.")
    _check(all(stops), "stop", "Stop strings must not be empty.")
    return tuple(stops)


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    if bias is None:
        return {}
    _check(isinstance(bias, dict), "logit_bias", "'logit_bias' must map token ids to numbers.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        _check(isinstance(key, str) and key.strip().isdigit(), "logit_bias", f"Invalid token id {key!r} in logit_bias.")
        _check(_is_number(value), "logit_bias", f"logit_bias[{key}] must be a number.")
        out[int(key)] = float(value)
    return out


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    _check(isinstance(value, list) and all(_is_int(t) and t >= 0 for t in value), name,
           f"'{name}' must be an array of non-negative token ids.")
    return value


# --- typed getters: null means "not given" -------------------------------------------------------
def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    _check(_is_number(value), name, f"'{name}' must be a number.")
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    _check(_is_int(value), name, f"'{name}' must be an integer.")
    return value


def _boolean(body: dict[str, Any], name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    _check(isinstance(value, bool), prefix + name, f"'{prefix}{name}' must be a boolean.")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _check(condition: Any, param: str, message: str) -> None:
    if not condition:
        raise invalid_request(message, param=param)
