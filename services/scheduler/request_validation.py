"""What the scheduler accepts: every request is checked once, when it arrives, so that a request no
frontend would have sent (one from a client connected straight to `EngineCoreService`, or from a
frontend with a bug) is refused alone and never reaches the worker, where a token id outside the
vocabulary or a NaN knob would fail a whole step.

The sampling ranges are the frontend's (services/frontend/protocol.py `check_sampling_params`), so
the internal API serves nothing the public ones would refuse; the lengths and token ids are checked
against what the worker reported (`KVCacheSpec`).
"""
from __future__ import annotations

import math

from services.common.messages import SamplingParams
from services.scheduler.request import Request

# As the frontend's limits (services/frontend/protocol.py): the same request is refused at either door.
MAX_LOGPROBS = 20
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_TEMPERATURE = 2.0
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# Ids are routing keys held for the request's life: a frontend makes ~40 characters; past this is abuse.
MAX_REQUEST_ID_CHARS = 1024


class RequestRejected(Exception):
    """A request the engine can never serve; `code` is the error class sent to the frontend."""

    def __init__(self, message: str, code: str = "invalid_argument"):
        super().__init__(message)
        self.code = code


def validate_request(request: Request, max_model_len: int, vocab_size: int | None) -> None:
    """Raises RequestRejected (invalid_argument) naming the first rule the request breaks.

    `vocab_size` None (a scheduler built without a worker, in tests and benchmarks) checks only that
    token ids are non-negative.
    """
    request_id = request.request_id
    _check(0 < len(request_id) <= MAX_REQUEST_ID_CHARS,
           f"the request id must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    _check(math.isfinite(request.arrival_time), "arrival_time must be a finite number of seconds")
    num_prompt_tokens = request.num_prompt_tokens
    _check(num_prompt_tokens > 0, "the prompt is empty")
    _check(num_prompt_tokens <= max_model_len,
           f"the prompt has {num_prompt_tokens} tokens, more than the maximum of {max_model_len}")
    _check_token_ids(request.prompt_token_ids, "prompt_token_ids", vocab_size)
    check_sampling_params(request.sampling_params, vocab_size)


def check_sampling_params(p: SamplingParams, vocab_size: int | None) -> None:
    """The knobs' ranges; comparisons are written so that NaN fails every one of them."""
    # The frontend turns n choices into n engine requests: the engine itself samples one sequence.
    _check(p.n == 1, f"n must be 1 (a frontend sends one engine request per choice), got {p.n}")
    _check(0.0 <= p.temperature <= MAX_TEMPERATURE,
           f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {p.temperature}")
    _check(0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}")
    _check(p.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {p.top_k}")
    _check(0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _check(-MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY,
               f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}")
    _check(0.0 < p.repetition_penalty < math.inf,
           f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}")
    _check(p.max_tokens >= 0, f"max_tokens must be >= 0 (0: up to the maximum length), got {p.max_tokens}")
    _check(p.min_tokens >= 0, f"min_tokens must be >= 0, got {p.min_tokens}")
    _check(not p.max_tokens or p.min_tokens <= p.max_tokens,
           f"min_tokens ({p.min_tokens}) exceeds max_tokens ({p.max_tokens})")
    _check(p.seed is None or MIN_SEED <= p.seed <= MAX_SEED, f"seed must fit in 64 bits, got {p.seed}")
    _check(p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
           f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")
    _check(p.prompt_logprobs is None, "prompt_logprobs are not supported")
    _check_token_ids(p.stop_token_ids, "stop_token_ids", vocab_size)
    if p.logit_bias:
        _check_token_ids(list(p.logit_bias), "logit_bias", vocab_size)
        for token_id, bias in p.logit_bias.items():
            _check(-MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS,
                   f"logit_bias[{token_id}] must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}")


def _check_token_ids(token_ids, what: str, vocab_size: int | None) -> None:
    if not token_ids:
        return
    # min and max run in C: a 100k-token prompt costs about a millisecond, once.
    low, high = min(token_ids), max(token_ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        where = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary (ids are >= 0)"
        raise RequestRejected(f"{what}: token id {bad} is outside {where}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RequestRejected(message)
