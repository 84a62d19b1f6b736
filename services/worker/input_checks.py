"""What the model runner checks of one request before it joins the batch, so that a request whose
inputs would make the step raise (a token id past the embedding table, a block id past the KV cache,
more tokens than `max_model_len`) fails alone instead of failing every request of its step.

The scheduler validates what it receives (services/scheduler/request_validation.py); these checks
are the second line, for inputs that reach the worker anyway. They run once per request (when it
is first sent or resumed) and for the blocks a running request gains, never per token.
"""
from __future__ import annotations

import math
from collections.abc import Collection

from services.common.messages import NewRequestData, SamplingParams


class RequestInputError(ValueError):
    """One request's inputs cannot run: only that request fails (the message says why)."""


def check_token_ids(token_ids: Collection[int], what: str, vocab_size: int) -> None:
    if token_ids and not (0 <= min(token_ids) and max(token_ids) < vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise RequestInputError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_block_ids(block_ids: list[int], num_blocks_held: int, num_blocks: int, max_num_blocks: int) -> None:
    """`num_blocks_held`: the request's blocks before these; `max_num_blocks`: what max_model_len needs."""
    if not block_ids:
        return
    if not (0 <= min(block_ids) and max(block_ids) < num_blocks):
        bad = next(b for b in block_ids if not 0 <= b < num_blocks)
        raise RequestInputError(f"block id {bad} is outside the KV cache [0, {num_blocks})")
    if num_blocks_held + len(block_ids) > max_num_blocks:
        raise RequestInputError(f"{num_blocks_held + len(block_ids)} blocks, more than max_model_len needs "
                                f"({max_num_blocks})")


def check_tokens(token_ids: list[int], num_computed_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """A request's known tokens (prompt, or prompt and outputs when resumed) and its computed count."""
    if len(token_ids) > max_model_len:
        raise RequestInputError(f"{len(token_ids)} tokens, more than max_model_len ({max_model_len})")
    if not 0 <= num_computed_tokens <= len(token_ids):
        raise RequestInputError(f"{num_computed_tokens} computed tokens of {len(token_ids)}")
    check_token_ids(token_ids, "token_ids", vocab_size)


def check_sampling_params(p: SamplingParams, vocab_size: int) -> None:
    """The knobs that index the logits (stop tokens, banned under min_tokens, and logit bias), and
    the float knobs whose NaN or out-of-range value would make the sampler raise for the batch."""
    knobs = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
             *p.logit_bias.values())
    if not all(map(math.isfinite, knobs)):
        raise RequestInputError("a sampling parameter is not a finite number")
    if p.temperature < 0 or not 0 < p.top_p <= 1 or not 0 <= p.min_p <= 1 or p.repetition_penalty <= 0:
        raise RequestInputError(f"sampling parameters out of range (temperature {p.temperature}, top_p "
                                f"{p.top_p}, min_p {p.min_p}, repetition_penalty {p.repetition_penalty})")
    check_token_ids(p.stop_token_ids, "stop_token_ids", vocab_size)
    check_token_ids(p.logit_bias.keys(), "logit_bias", vocab_size)
    if p.logprobs is not None and not 0 <= p.logprobs <= vocab_size:
        raise RequestInputError(f"logprobs {p.logprobs} is outside [0, {vocab_size}]")


def check_new_request(new: NewRequestData, vocab_size: int, num_blocks: int, max_model_len: int,
                      max_num_blocks: int) -> None:
    check_tokens(new.prompt_token_ids, new.num_computed_tokens, vocab_size, max_model_len)
    if not new.prompt_token_ids:
        raise RequestInputError("the prompt is empty")
    check_block_ids(new.block_ids, 0, num_blocks, max_num_blocks)
    check_sampling_params(new.sampling_params, vocab_size)
