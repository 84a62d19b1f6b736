"""Token embedding and the language-model head (which may share its weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; with tied embeddings it reuses their weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.is_tied = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)
