"""Converts the public gRPC API's messages (generate.proto) to the frontend's dataclasses and back.

The public API has its own messages, apart from the internal frontend <-> scheduler ones that
`services.common.codec` converts, so either can change alone: the two meet only in the dataclasses
of `messages` and `protocol`, never as protobuf. Decoding validates as `protocol` does for HTTP
bodies: every refusal is a 400 naming the field.
"""
from __future__ import annotations

import dataclasses

from services.common import messages
from services.common.pb import generate_pb2 as pb
from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.errors import invalid_request
from services.frontend.structured_outputs import parse_constraint
from services.frontend.protocol import CompletionRequest, GenerationOptions, check_sampling_params
from services.frontend.serving_engine import TextDelta

_FINISH_REASONS = {
    None: pb.GenerateResponse.FINISH_REASON_UNSPECIFIED,
    "stop": pb.GenerateResponse.FINISH_REASON_STOP,
    "length": pb.GenerateResponse.FINISH_REASON_LENGTH,
}


# --- requests ------------------------------------------------------------------------------------
def sampling_params_from_pb(msg: pb.GenerateRequest.SamplingParams) -> messages.SamplingParams:
    """Proto3 zero values mean "unset" where zero is meaningless: n 0 is 1, top_p and
    repetition_penalty 0 are 1; top_k -1 is vLLM's spelling of "disabled", as 0 is."""
    return messages.SamplingParams(
        n=msg.n or 1,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        top_k=0 if msg.top_k == -1 else msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty > 0 else 1.0,
        logit_bias=dict(msg.logit_bias),
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def generate_request_from_pb(msg: pb.GenerateRequest) -> CompletionRequest:
    """The request as the completions endpoint's typed request: a text or token-id prompt and options.

    `request_id` is not part of it: it names the gRPC call, not the engine request.
    """
    options = _options_from_pb(msg)
    kind = msg.WhichOneof("input")
    if kind == "text":
        if not msg.text:
            raise invalid_request("'text' must not be empty.", param="text")
        prompt: str | list[int] = msg.text
    elif kind == "token_ids":
        prompt = list(msg.token_ids.token_ids)
    else:
        raise invalid_request("Set 'text' or 'token_ids'.", param="input")
    return CompletionRequest(prompt=prompt, options=options)


def _constraint_from_pb(msg: pb.GenerateRequest) -> tuple[StructuredOutputsParams, str] | None:
    """Read as the HTTP API reads `structured_outputs`, so both refuse the same things alike."""
    if not msg.HasField("structured_outputs"):
        return None
    so = msg.structured_outputs
    kind = so.WhichOneof("constraint")
    if kind is None:
        raise invalid_request("Set one constraint in 'structured_outputs'.", param="structured_outputs")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return parse_constraint({"structured_outputs": {kind: value, "disable_any_whitespace": not so.any_whitespace}})


def _options_from_pb(msg: pb.GenerateRequest) -> GenerationOptions:
    params = sampling_params_from_pb(msg.sampling_params)  # unset reads as all zeros: every default
    constraint = _constraint_from_pb(msg)
    if constraint is not None:
        params = dataclasses.replace(params, structured_outputs=constraint[0])
    check_sampling_params(params)
    if params.max_tokens < 0:
        raise invalid_request("'max_tokens' must be >= 0 (0: as many as fit).", param="max_tokens")
    stop = tuple(msg.stop)
    if not all(stop):
        raise invalid_request("Stop strings must not be empty.", param="stop")
    return GenerationOptions(
        model=msg.model or None,
        sampling_params=params,
        max_tokens=params.max_tokens or None,
        max_tokens_param="max_tokens",
        stop=stop,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        priority=msg.priority,
        constraint_param=constraint[1] if constraint is not None else "",
    )


# --- responses -----------------------------------------------------------------------------------
def finish_reason_to_pb(reason: str | None) -> int:
    """A `TextDelta`'s reason ("stop", "length" or None while running) as the public enum."""
    return _FINISH_REASONS[reason]


def token_logprobs_to_pb(lp: messages.TokenLogprobs | None) -> pb.GenerateResponse.TokenLogprobs:
    if lp is None:  # rank 0 marks "absent": real ranks start at 1
        return pb.GenerateResponse.TokenLogprobs()
    return pb.GenerateResponse.TokenLogprobs(
        logprob=lp.logprob,
        rank=lp.rank,
        top_logprobs=[pb.GenerateResponse.TopLogprob(token_id=t, logprob=v) for t, v in lp.top_logprobs],
    )


def generate_response_to_pb(request_id: str, index: int, delta: TextDelta, num_prompt_tokens: int,
                            num_completion_tokens: int) -> pb.GenerateResponse:
    """One choice's delta; `num_completion_tokens` counts that choice's tokens so far."""
    return pb.GenerateResponse(
        request_id=request_id,
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=finish_reason_to_pb(delta.finish_reason),
        num_prompt_tokens=num_prompt_tokens,
        num_completion_tokens=num_completion_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        index=index,
        logprobs=[token_logprobs_to_pb(lp) for lp in delta.logprobs],
    )


def model_info_to_pb(model_name: str, max_model_len: int, eos_token_ids: tuple[int, ...],
                     info: messages.EngineInfo) -> pb.GetModelInfoResponse:
    """The served model (its name and context length as the frontend serves it) and the engine's facts."""
    return pb.GetModelInfoResponse(
        model_name=model_name, max_model_len=max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=list(eos_token_ids), block_size=info.block_size, device=info.device, dtype=info.dtype)
