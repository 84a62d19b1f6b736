"""Tensor parallelism applied to a model as it is built, so the model code stays rank-free.

The model is constructed from the rank's copy of the HF config (its local head and intermediate
counts), which makes the fused QKV and gate-up projections column-parallel by their size alone;
`parallelize` then swaps each row-parallel projection (o_proj, down_proj) for a
`RowParallelLinear`, which all-reduces its output, and the LM head for a `VocabParallelLMHead`
(its vocabulary slice, gathered to rank 0), before any weight is loaded; and the checkpoint is
read through `slice_weights`, which cuts each tensor to the rank's part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.linear import Linear
from services.worker.parallel.process_group import TensorParallelGroup
from services.worker.parallel.shard_plan import ShardPlan
from services.worker.parallel.vocab_parallel import VocabParallelLMHead
from services.worker.parallel.weights import ROW_PARALLEL, shard_weights


class RowParallelLinear(Linear):
    """A projection whose input is split over the ranks: each computes a partial sum of the output
    (with the bias on rank 0 only), and the all-reduce adds them up."""

    def __init__(self, input_size: int, output_size: int, bias: bool, group: TensorParallelGroup):
        super().__init__(input_size, output_size, bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


@dataclass(frozen=True)
class ModelShard:
    """What rank `group.rank` holds of a model split by `plan`."""

    plan: ShardPlan
    group: TensorParallelGroup

    @property
    def rank(self) -> int:
        return self.group.rank

    def local_hf_config(self, hf_config):
        return self.plan.local_hf_config(hf_config, self.rank)

    def parallelize(self, model: nn.Module) -> int:
        """Replaces every row-parallel projection and the LM head (all still unloaded) in `model`;
        returns how many modules it replaced."""
        targets = [(name, module) for name, module in model.named_modules()
                   if name.rsplit(".", 1)[-1] in ROW_PARALLEL and type(module) is Linear]
        for name, module in targets:
            replacement = RowParallelLinear(module.input_size, module.output_size, module.bias is not None,
                                            self.group)
            _replace(model, name, replacement)
        heads = [(name, module) for name, module in model.named_modules() if type(module) is LMHead]
        vocab_slices = tuple(r.vocab for r in self.plan.ranks)
        for name, head in heads:
            tied_to = None
            if head.is_tied:  # the embedding whose matrix the head shares
                tied_to = next(m for m in model.modules() if isinstance(m, VocabEmbedding) and m.weight is head.weight)
            _replace(model, name, VocabParallelLMHead(head.weight.shape[1], vocab_slices, self.group, tied_to))
        return len(targets) + len(heads)

    def slice_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return shard_weights(weights, self.plan, self.rank)


def _replace(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, replacement)
