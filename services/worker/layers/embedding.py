"""Token embedding and the language-model head (which may share its weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.linear import linear, linear_16bit_with_copy, pack_weight, packed_linear


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
        # oneDNN layout: the weight in its own dtype after prepack(), or a float32 copy beside a 16-bit one.
        self.packed_weight: torch.Tensor | None = None
        self.weight_is_packed = False

    def prepack(self) -> None:
        """A oneDNN copy of the CPU weight in its dtype; a tied weight stays for the embedding lookup."""
        self.packed_weight = pack_weight(self.weight)
        if not self.is_tied:
            self.weight.data = self.weight.data.new_empty(0)
        self.weight_is_packed = True

    def add_float32_copy(self) -> None:
        """Beside a 16-bit weight, a float32 oneDNN copy for projections of more than a few rows."""
        self.packed_weight = pack_weight(self.weight.float())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return linear(hidden_states, self.weight)
        if self.weight_is_packed:
            return packed_linear(hidden_states, self.packed_weight, None)
        return linear_16bit_with_copy(hidden_states, self.weight, None, self.packed_weight, None)
