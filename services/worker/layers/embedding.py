"""Token embedding and the language-model head (which may share its weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.linear import LinearBase


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(LinearBase):
    """Projects hidden states to vocabulary logits; with tied embeddings it reuses their weight
    (and keeps it when prepacked, for the embedding lookup)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__(keeps_weight_when_packed=tied_to is not None)
        self.is_tied = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.bias = None
