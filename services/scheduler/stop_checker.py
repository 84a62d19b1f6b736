"""Finishing rules, applied after each sampled token."""
from __future__ import annotations

from services.common.messages import FinishReason
from services.scheduler.request import Request


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
