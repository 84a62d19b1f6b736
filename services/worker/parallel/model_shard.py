"""Tensor parallelism applied to a model as it is built, so the model code stays rank-free.

The model is constructed from the rank's copy of the HF config (its local head and intermediate
counts), which makes the fused QKV and gate-up projections column-parallel by their size alone;
`parallelize` then swaps each row-parallel projection (o_proj, down_proj) for a
`RowParallelLinear`, which all-reduces its output, before any weight is loaded; and the checkpoint
is read through `slice_weights`, which cuts each tensor to the rank's part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from services.worker.layers.linear import Linear
from services.worker.parallel.process_group import TensorParallelGroup
from services.worker.parallel.shard_plan import ShardPlan
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
        """Replaces every row-parallel projection (still unloaded) in `model`; returns how many."""
        targets = [(name, module) for name, module in model.named_modules()
                   if name.rsplit(".", 1)[-1] in ROW_PARALLEL and type(module) is Linear]
        for name, module in targets:
            parent_name, _, attr = name.rpartition(".")
            replacement = RowParallelLinear(module.input_size, module.output_size, module.bias is not None,
                                            self.group)
            setattr(model.get_submodule(parent_name), attr, replacement)
        return len(targets)

    def slice_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return shard_weights(weights, self.plan, self.rank)
