"""Converts vLLM's engine protocol (`vllm.grpc.engine`, the `smg-grpc-proto` stubs) to the
frontend's dataclasses and back.

Requests become the completions endpoint's typed request (`CompletionRequest`: a text or token-id
prompt and `GenerationOptions`), so they meet the one serving path with the same checks as HTTP
and `GenerateService`; every refusal is a 400 (INVALID_ARGUMENT) naming the proto field. Proto3
zero values mean "unset" where zero means nothing: n 0 is 1, top_p and repetition_penalty 0 are
the defaults (`SamplingDefaults`), top_k 0 is off. Fields this engine cannot honour are refused
rather than ignored (prompt logprobs, prompt truncation, multimodal inputs, KV transfer, a
data-parallel rank other than 0).
`spaces_between_special_tokens` (decoding cosmetics) and `grammar_from_first_token` (our grammar
always starts at the first generated token: there is no reasoning parser to wait for) are accepted.

`skip_special_tokens` is taken as given, as vLLM takes it (proto3 reads an unset field as false):
it only shapes the text that stop strings are searched in, since the caller detokenizes the token
ids itself. JSON constraints are compact JSON (no free whitespace), as on the HTTP API.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from services.common.messages import SamplingParams, TokenLogprobs
from services.common.sampling_limits import MAX_LOGPROBS
from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.errors import APIError, invalid_request
from services.frontend.generation_defaults import SAMPLING_KEYS
from services.frontend.protocol import CompletionRequest, GenerationOptions, check_sampling_params
from services.frontend.structured_outputs import parse_constraint

# The proto's constraint fields and the `structured_outputs` kinds they are.
_CONSTRAINT_KINDS = {
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
    "choice": "choice",
}
# Fields refused because this engine would silently do something else with them.
_REFUSED_SAMPLING_FIELDS = {
    "prompt_logprobs": "Prompt logprobs are not supported yet.",
    "truncate_prompt_tokens": "Prompt truncation is not supported; send a prompt that fits.",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """The model author's sampling defaults (generation_config.json's temperature, top_p, top_k,
    min_p, repetition_penalty) for the knobs a caller leaves unset; empty: our own defaults.

    Only knobs whose "unset" the proto can tell get them here: temperature (an optional field),
    top_p and repetition_penalty (0 is no valid value). top_k and min_p 0 mean "off", as in vLLM.
    `to_json` is what GetModelInfo reports, so a gateway fills in every one of them itself, as SMG
    does for the clients' omitted fields.
    """

    values: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def temperature(self, params: pb.SamplingParams) -> float:
        if params.HasField("temperature"):
            return params.temperature
        return self.values.get("temperature", SamplingParams.temperature)

    def top_p(self, params: pb.SamplingParams) -> float:
        return params.top_p if params.top_p > 0 else self.values.get("top_p", SamplingParams.top_p)

    def repetition_penalty(self, params: pb.SamplingParams) -> float:
        if params.repetition_penalty > 0:
            return params.repetition_penalty
        return self.values.get("repetition_penalty", SamplingParams.repetition_penalty)

    def to_json(self) -> str:
        return json.dumps({key: self.values[key] for key in SAMPLING_KEYS if key in self.values})


# --- requests ------------------------------------------------------------------------------------
def generate_request_from_pb(msg: pb.GenerateRequest, defaults: SamplingDefaults) -> CompletionRequest:
    """The request as a completions request; `request_id` names the call, not the engine request."""
    _refuse_unsupported(msg)
    kind = msg.WhichOneof("input")
    if kind == "tokenized":
        prompt: str | list[int] = list(msg.tokenized.input_ids)
    elif kind == "text":
        if not msg.text:
            raise invalid_request("'text' must not be empty.", param="text")
        prompt = msg.text
    else:
        raise invalid_request("Set 'tokenized' or 'text'.", param="input")
    return CompletionRequest(prompt=prompt, options=_options_from_pb(msg, defaults))


def prompt_param(prompt: str | list[int]) -> str:
    """The field a prompt came from, for errors about it (empty, too long, unknown token ids)."""
    return "text" if isinstance(prompt, str) else "tokenized.input_ids"


def _refuse_unsupported(msg: pb.GenerateRequest) -> None:
    params = msg.sampling_params
    for field, message in _REFUSED_SAMPLING_FIELDS.items():
        if params.HasField(field):
            raise invalid_request(message, param=f"sampling_params.{field}")
    if params.HasField("logprobs") and params.logprobs == -1:
        raise invalid_request(f"logprobs -1 (all) is not supported; ask for at most {MAX_LOGPROBS}.",
                              param="sampling_params.logprobs")
    for field in ("mm_inputs", "media_refs"):
        if msg.HasField(field):
            raise invalid_request(f"This engine serves text-only models: '{field}' is not supported.", param=field)
    if msg.extra_mm_inputs:
        raise invalid_request("This engine serves text-only models: 'extra_mm_inputs' is not supported.",
                              param="extra_mm_inputs")
    for field in ("kv_transfer_params", "kv_transfer_params_json"):
        if msg.HasField(field):
            raise invalid_request("KV transfer (prefill/decode disaggregation) is not supported.", param=field)
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise invalid_request(f"This engine has one data-parallel rank (0), got {msg.data_parallel_rank}.",
                              param="data_parallel_rank")


def _constraint_from_pb(params: pb.SamplingParams) -> tuple[StructuredOutputsParams, str] | None:
    """Read as the HTTP API reads `structured_outputs`, so both refuse the same things alike."""
    field = params.WhichOneof("constraint")
    if field is None:
        return None
    kind, param = _CONSTRAINT_KINDS[field], f"sampling_params.{field}"
    value = list(params.choice.choices) if field == "choice" else getattr(params, field)
    try:
        found = parse_constraint({"structured_outputs": {kind: value}})
    except APIError as err:  # named after our field, not the HTTP one
        raise invalid_request(err.message.replace(f"structured_outputs.{kind}", param), param=param) from None
    return None if found is None else (found[0], param)  # None: json_object false


def _options_from_pb(msg: pb.GenerateRequest, defaults: SamplingDefaults) -> GenerationOptions:
    p = msg.sampling_params  # unset reads as all zeros: every default
    if p.HasField("max_tokens") and p.max_tokens == 0:
        raise invalid_request("'max_tokens' must be at least 1 (unset: as many as fit).",
                              param="sampling_params.max_tokens")
    if not all(p.stop):
        raise invalid_request("Stop strings must not be empty.", param="sampling_params.stop")
    constraint = _constraint_from_pb(p)
    params = SamplingParams(
        n=p.n or 1,
        temperature=defaults.temperature(p),
        top_p=defaults.top_p(p),
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=defaults.repetition_penalty(p),
        logit_bias=dict(p.logit_bias),
        max_tokens=p.max_tokens or 1,  # a placeholder until the prompt length is known
        min_tokens=p.min_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        structured_outputs=constraint[0] if constraint is not None else None,
    )
    try:
        check_sampling_params(params)
    except APIError as err:
        raise invalid_request(err.message, param=f"sampling_params.{err.param}") from None
    return GenerationOptions(
        model=None,
        sampling_params=params,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        max_tokens_param="sampling_params.max_tokens",
        stop=tuple(p.stop),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        is_stream=msg.stream,
        constraint_param=constraint[1] if constraint is not None else "",
    )


# --- responses -----------------------------------------------------------------------------------
def output_logprobs_to_pb(token_ids: list[int], logprobs: list[TokenLogprobs],
                          num_top_logprobs: int) -> pb.OutputLogProbs:
    """One entry per token: its logprob and, when asked for, the top alternatives."""
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=token_ids[:len(logprobs)],
        top_logprobs=[pb.TopLogProbs(values=[v for _, v in lp.top_logprobs], token_ids=[t for t, _ in lp.top_logprobs])
                      for lp in logprobs] if num_top_logprobs > 0 else [],
    )


def chunk_to_pb(index: int, token_ids: list[int], num_prompt_tokens: int, num_completion_tokens: int,
                num_cached_tokens: int, logprobs: pb.OutputLogProbs | None) -> pb.GenerateResponse:
    """New tokens of one choice; `num_completion_tokens` counts that choice's tokens so far."""
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=token_ids, prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
        cached_tokens=num_cached_tokens, output_logprobs=logprobs, index=index))


def complete_to_pb(index: int, output_ids: list[int], finish_reason: str, num_prompt_tokens: int,
                   num_cached_tokens: int, logprobs: pb.OutputLogProbs | None,
                   matched_stop: int | str | None) -> pb.GenerateResponse:
    """The whole of one finished choice. `matched_stop`: the token id (EOS or a stop token) or the
    stop string that ended it; None for any other finish."""
    complete = pb.GenerateComplete(
        output_ids=output_ids, finish_reason=finish_reason, prompt_tokens=num_prompt_tokens,
        completion_tokens=len(output_ids), cached_tokens=num_cached_tokens, output_logprobs=logprobs, index=index)
    if isinstance(matched_stop, str):
        complete.matched_stop_str = matched_stop
    elif matched_stop is not None:
        complete.matched_token_id = matched_stop
    return pb.GenerateResponse(complete=complete)
