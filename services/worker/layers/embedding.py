"""Token embedding and the language-model head (which may share its weight)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.linear import LinearBase

if TYPE_CHECKING:
    from services.worker.layers.greedy_head import GreedyHeadScreen
    from services.worker.layers.int8_linear import Int8Weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.int8_weight: Int8Weight | None = None  # a tied LM head's, once quantized
        self.int8_dtype = torch.float32  # the rows' dtype when read from `int8_weight`

    def use_int8(self, int8_weight: Int8Weight, dtype: torch.dtype) -> None:
        """Looks rows up in `int8_weight` (the tied LM head's) from now on, dequantized into `dtype`."""
        self.int8_weight, self.int8_dtype = int8_weight, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.int8_weight is not None:
            return self.int8_weight.embedding(input_ids, self.int8_dtype)
        return F.embedding(input_ids, self.weight)


class LMHead(LinearBase):
    """Projects hidden states to vocabulary logits; with tied embeddings it reuses their weight
    (and keeps it when prepacked, for the embedding lookup)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__(keeps_weight_when_packed=tied_to is not None)
        self.is_tied = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.bias = None
        # bfloat16 weights: greedy steps' tokens from an int8 copy and a check on this weight.
        self.greedy_screen: GreedyHeadScreen | None = None
