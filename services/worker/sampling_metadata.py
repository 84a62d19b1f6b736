"""Per-step sampling tensors, materialised only for the knobs the batch actually uses."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.messages import SamplingParams

@dataclass(frozen=True)
class SamplingMetadata:
    """Row i describes logits row i. A None tensor means no row of the batch uses that knob."""

    all_greedy: bool
    is_greedy: torch.Tensor | None  # [N] bool, None when all rows are greedy or all random
    temperature: torch.Tensor | None  # [N, 1], 1.0 on greedy rows; None when all greedy
    top_k: torch.Tensor | None  # [N] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [N] float
    min_p: torch.Tensor | None  # [N] float
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded rows
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None = not requested
    # Logits processors (see logits_processors.py); empty/None when unused.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, biases
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids (min_tokens not reached)
    penalties: "PenaltyMetadata | None" = None

    @property
    def max_num_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None


@dataclass(frozen=True)
class PenaltyMetadata:
    presence: torch.Tensor  # [N, 1]
    frequency: torch.Tensor  # [N, 1]
    repetition: torch.Tensor  # [N, 1]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]


def build_sampling_metadata(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Row i samples for a request with `params[i]`, `generators[i]` and its tokens so far."""
    greedy = [p.is_greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    random_rows = [p for p, g in zip(params, greedy) if not g]

    def column(values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    temperature = top_k = top_p = min_p = None
    if not all_greedy:
        temperature = column([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)[:, None]
        if any(0 < p.top_k < vocab_size for p in random_rows):
            top_k = column([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.long)
        if any(p.top_p < 1.0 for p in random_rows):
            top_p = column([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in random_rows):
            min_p = column([p.min_p for p in params], torch.float32)
    seeded = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}
    return SamplingMetadata(
        all_greedy=all_greedy,
        is_greedy=None if all_greedy or all_random else column(greedy, torch.bool),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=seeded,
        num_logprobs=[p.logprobs for p in params],
        logit_bias=_logit_bias(params, device),
        banned=_banned(params, output_token_ids, eos_token_ids, device),
        penalties=_penalties(params, prompt_token_ids, output_token_ids, device),
    )


def _logit_bias(params, device):
    rows, tokens, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            rows.append(i), tokens.append(int(token)), biases.append(float(bias))
    if not rows:
        return None
    return (torch.tensor(rows, device=device), torch.tensor(tokens, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def _banned(params, output_token_ids, eos_token_ids, device):
    """Stop tokens are banned while a request has fewer than min_tokens outputs."""
    rows, tokens = [], []
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) < p.min_tokens:
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            rows += [i] * len(stop_ids)
            tokens += sorted(stop_ids)
    if not rows:
        return None
    return torch.tensor(rows, device=device), torch.tensor(tokens, device=device)


def _penalties(params, prompt_token_ids, output_token_ids, device):
    if not any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        return None

    def column(values):
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    return PenaltyMetadata(
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        repetition=column([p.repetition_penalty for p in params]),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
    )
