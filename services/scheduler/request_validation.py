"""What the scheduler accepts: every request is checked once, when it arrives, so that a request no
frontend would have sent (one from a client connected straight to `EngineCoreService`, or from a
frontend with a bug) is refused alone and never reaches the worker, where a token id outside the
vocabulary or a NaN knob would fail a whole step.

The sampling ranges are the public APIs' (services/common/sampling_limits.py), so the internal API
serves nothing the public ones would refuse; the lengths and token ids are checked against what the
worker reported (`KVCacheSpec`).
"""
from __future__ import annotations

import math

from services.common.messages import SamplingParams
from services.common.sampling_limits import sampling_params_violation
from services.common.structured_outputs import structured_outputs_violation
from services.scheduler.request import Request

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
    """The public APIs' ranges, and what only the engine can check: one sequence per request, the
    lengths against each other, token ids against the vocabulary."""
    # The frontend turns n choices into n engine requests: the engine itself samples one sequence.
    _check(p.n == 1, f"n must be 1 (a frontend sends one engine request per choice), got {p.n}")
    violation = sampling_params_violation(p)
    if violation is not None:
        raise RequestRejected(violation[1])
    _check(p.max_tokens >= 0, f"max_tokens must be >= 0 (0: up to the maximum length), got {p.max_tokens}")
    _check(not p.max_tokens or p.min_tokens <= p.max_tokens,
           f"min_tokens ({p.min_tokens}) exceeds max_tokens ({p.max_tokens})")
    _check_token_ids(p.stop_token_ids, "stop_token_ids", vocab_size)
    if p.logit_bias:
        _check_token_ids(list(p.logit_bias), "logit_bias", vocab_size)
    if p.structured_outputs is not None:
        violation = structured_outputs_violation(p.structured_outputs)
        if violation is not None:
            raise RequestRejected(violation)


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
