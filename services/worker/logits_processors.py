"""Logit adjustments applied before sampling (and before the greedy argmax): logit bias, stop
tokens banned until min_tokens, and presence/frequency/repetition penalties (OpenAI and vLLM
semantics: presence/frequency count output tokens, repetition counts prompt and output)."""
from __future__ import annotations

import numpy as np
import torch

from services.worker.kernels.sampling_ops import merge_entries
from services.worker.sampling_metadata import PenaltyMetadata, SamplingMetadata


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Returns adjusted logits (the input is modified in place when anything applies)."""
    device = logits.device
    if metadata.logit_bias is not None:
        rows, tokens, biases = (torch.from_numpy(a).to(device) for a in metadata.logit_bias)
        logits.index_put_((rows, tokens), biases, accumulate=True)
    if metadata.penalties is not None:
        logits = _apply_penalties(logits, metadata.penalties)
    if metadata.banned is not None:
        rows, tokens = (torch.from_numpy(a).to(device) for a in metadata.banned)
        logits.index_put_((rows, tokens), torch.tensor(float("-inf"), device=device))
    return logits


def _apply_penalties(logits: torch.Tensor, p: PenaltyMetadata) -> torch.Tensor:
    """Only the tokens a penalised row has seen change, so only those (row, token) entries are
    gathered, adjusted and written back; every other logit keeps its value (as dense factors of
    1 and 0 would leave it), and no [N, vocab] count table is built."""
    entries = merge_entries(penalty_tokens=(p.rows, p.prompt_token_ids, p.output_token_ids))
    rows, tokens, counts = torch.from_numpy(np.stack([entries.rows, entries.tokens, entries.output_counts])).to(
        logits.device).long()
    counts = counts.float()
    values = logits[rows, tokens]
    # Repetition: positive logits divided, negative multiplied, for every token seen anywhere.
    repetition = p.repetition[rows, 0]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= p.frequency[rows, 0] * counts
    values -= p.presence[rows, 0] * (counts > 0).float()
    logits[rows, tokens] = values
    return logits
