"""Token embedding and the language-model head (which may share its weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.linear import MAX_NATIVE_16BIT_ROWS, chunked_linear, packed_linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; with tied embeddings it reuses their weight."""

    CHUNK_ROWS = 1024  # vocabulary rows widened per matmul for 16-bit weights on a CPU

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.is_tied = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.packed_weight: torch.Tensor | None = None

    def prepack(self) -> None:
        """A oneDNN copy of the float32 CPU weight; a tied weight stays for the embedding lookup."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not self.is_tied:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(hidden_states, self.packed_weight, None)
        weight = self.weight
        widen = weight.device.type == "cpu" and weight.dtype != torch.float32
        if widen and hidden_states.shape[0] > MAX_NATIVE_16BIT_ROWS:
            return chunked_linear(hidden_states, weight, None, self.CHUNK_ROWS)
        return F.linear(hidden_states, weight)
