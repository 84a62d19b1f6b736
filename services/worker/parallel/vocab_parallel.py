"""The LM head split by vocabulary: each rank multiplies its contiguous slice of the head's rows
(`RankShard.vocab`), and the slices' logits are gathered to rank 0, which alone samples.

Why split, and why a gather: on two gloo ranks with prepacked weights (docs/benchmarks.md), the
split head with a gather to rank 0 was faster than the replicated head on rank 0 at 1 and 32 rows,
in float32 and bfloat16 (shard_plan.py has the figures); an all-gather of the same slices was
slower than the gather in all four cases, and no rank but 0 needs the logits. The slices cross in
the head's dtype, as one rank's logits reach the sampler.

With tied embeddings the slice is a view of the replicated embedding matrix, not a copy. The CPU
platform's prepack then packs that slice alone into its own oneDNN copy and keeps the view (the
embedding still looks rows up in the full matrix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.embedding import VocabEmbedding
from services.worker.layers.linear import LinearBase
from services.worker.parallel.process_group import TensorParallelGroup


class VocabParallelLMHead(LinearBase):
    """Logits of vocabulary rows `vocab_slices[group.rank]` on every rank; `forward` returns the full
    logits [rows, vocab_size] on rank 0 and None on the others."""

    def __init__(self, hidden_size: int, vocab_slices: tuple[range, ...], group: TensorParallelGroup,
                 tied_to: VocabEmbedding | None = None):
        super().__init__(keeps_weight_when_packed=tied_to is not None)
        self.group = group
        self.vocab = vocab_slices[group.rank]
        self.slice_sizes = tuple(len(r) for r in vocab_slices)
        self.is_tied = tied_to is not None
        self.bias = None
        self.greedy_screen = None  # the greedy head screen (layers/greedy_head.py) is a one-rank head's only
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(len(self.vocab), hidden_size))
        else:
            # A plain tensor, not a parameter: the embedding owns and loads these rows.
            self.weight = tied_to.weight.detach()[self.vocab.start : self.vocab.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        local = super().forward(x)
        max_size = max(self.slice_sizes)
        if local.shape[1] < max_size:  # a gather takes equal shapes: pad the shorter slices
            local = F.pad(local, (0, max_size - local.shape[1]))
        parts = self.group.gather(local)
        if parts is None:
            return None
        return torch.cat([part[:, :size] for part, size in zip(parts, self.slice_sizes, strict=True)], dim=1)
