"""Logit adjustments applied before sampling (and before the greedy argmax): logit bias, stop
tokens banned until min_tokens, and presence/frequency/repetition penalties (OpenAI and vLLM
semantics: presence/frequency count output tokens, repetition counts prompt and output)."""
from __future__ import annotations

import torch

from services.worker.sampling_metadata import PenaltyMetadata, SamplingMetadata


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Returns adjusted logits (the input is modified in place when anything applies)."""
    if metadata.logit_bias is not None:
        rows, tokens, biases = metadata.logit_bias
        logits.index_put_((rows, tokens), biases, accumulate=True)
    if metadata.penalties is not None:
        logits = _apply_penalties(logits, metadata.penalties)
    if metadata.banned is not None:
        logits.index_put_(metadata.banned, torch.tensor(float("-inf"), device=logits.device))
    return logits


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    for row, tokens in enumerate(token_lists):
        if tokens:
            ids = torch.tensor(tokens, device=device)
            counts[row].index_add_(0, ids, torch.ones(len(tokens), device=device))
    return counts


def _apply_penalties(logits: torch.Tensor, p: PenaltyMetadata) -> torch.Tensor:
    vocab_size = logits.shape[1]
    output_counts = _token_counts(p.output_token_ids, vocab_size, logits.device)
    prompt_seen = _token_counts(p.prompt_token_ids, vocab_size, logits.device) > 0
    seen = prompt_seen | (output_counts > 0)
    # Repetition: positive logits divided, negative multiplied, for every token seen anywhere.
    repetition = torch.where(seen, p.repetition.expand_as(logits), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits -= p.frequency * output_counts
    logits -= p.presence * (output_counts > 0).float()
    return logits
