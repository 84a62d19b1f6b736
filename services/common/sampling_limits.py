"""The ranges every sampling knob must be in, one rule set for every door that takes
`SamplingParams`: the public APIs (services/frontend/protocol.py) and the scheduler
(services/scheduler/request_validation.py) refuse the same values, each with its own error type.
Comparisons are written so that NaN fails every one of them."""
from __future__ import annotations

import math

from services.common.messages import SamplingParams

MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's chat limit (completions: 5, vLLM allows 20)
MAX_TEMPERATURE = 2.0
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


def sampling_params_violation(p: SamplingParams) -> tuple[str, str] | None:
    """(param, message) for the first knob out of its range, None when every one is in range.
    `n` is left to each door (the public APIs take up to MAX_N, the engine exactly one)."""
    if not 0.0 <= p.temperature <= MAX_TEMPERATURE:
        return "temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {p.temperature}."
    if not 0.0 < p.top_p <= 1.0:
        return "top_p", f"top_p must be in (0, 1], got {p.top_p}."
    if not p.top_k >= 0:
        return "top_k", f"top_k must be >= 0 (0 disables it), got {p.top_k}."
    if not 0.0 <= p.min_p <= 1.0:
        return "min_p", f"min_p must be in [0, 1], got {p.min_p}."
    for name, value in (("presence_penalty", p.presence_penalty), ("frequency_penalty", p.frequency_penalty)):
        if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
            return name, f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}."
    if not 0.0 < p.repetition_penalty < math.inf:
        return "repetition_penalty", f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}."
    if not p.min_tokens >= 0:
        return "min_tokens", f"min_tokens must be >= 0, got {p.min_tokens}."
    if p.seed is not None and not MIN_SEED <= p.seed <= MAX_SEED:
        return "seed", f"seed must fit in 64 bits, got {p.seed}."
    for token_id, bias in p.logit_bias.items():
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            return "logit_bias", (f"logit_bias[{token_id}] must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                  f"{MAX_ABS_LOGIT_BIAS:g}], got {bias}.")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        return "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}."
    if p.prompt_logprobs is not None:
        return "prompt_logprobs", "prompt_logprobs are not supported yet."
    return None
