"""The finishing rule, in one place: which tokens and lengths can end a request, and whether its
last token did.

`init_stop_triggers` runs once when the scheduler accepts a request; `may_stop` is the cheap test
after each sampled token (the full `check_stop` runs only when it says yes); `max_num_tokens` is
also the length past which the scheduler schedules nothing more while a step is in flight.
"""
from __future__ import annotations

import sys

from services.common.messages import FinishReason
from services.scheduler.request import Request


def init_stop_triggers(request: Request, max_model_len: int) -> None:
    """Sets the request's stop triggers: EOS (unless ignored) and stop tokens, and its length limit
    (prompt + max_tokens, never past the max model length)."""
    params = request.sampling_params
    request.stop_check_token_ids = frozenset(params.stop_token_ids).union(
        () if params.ignore_eos else request.eos_token_ids)
    limit = request.num_prompt_tokens + params.max_tokens if params.max_tokens else sys.maxsize
    request.max_num_tokens = min(limit, max_model_len)


def may_stop(request: Request, token_id: int) -> bool:
    """Whether the request's last token (`token_id`, already appended) can have finished it."""
    return token_id in request.stop_check_token_ids or len(request.all_token_ids) >= request.max_num_tokens


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None]:
    """Returns (reason, stop token id) for the request's last token; NONE while it goes on.

    EOS and stop tokens count only once `min_tokens` are out; EOS not at all with `ignore_eos`.
    """
    params = request.sampling_params
    last = request.all_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return FinishReason.STOP, None
        if last in params.stop_token_ids:
            return FinishReason.STOP, last
    if params.max_tokens and request.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH, None
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return FinishReason.NONE, None
