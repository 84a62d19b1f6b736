"""Linear layers whose weights load from one or several checkpoint tensors.

`MergedLinear` stacks several checkpoint projections (q/k/v, gate/up) along the output dimension
so one matmul replaces several; `load_shard` copies one of them into its slice at load time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters are left uninitialised: weights always come from a checkpoint."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input, concatenated along the output dimension."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self._offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        """Copies the checkpoint tensor of projection number `shard` into its rows of `param`."""
        start, size = self._offsets[shard], self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard}: expected {size} output rows, checkpoint has {tuple(loaded.shape)}")
        param.data[start : start + size].copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """The q, k and v projections of attention in one matmul (shards 0, 1, 2)."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(
            hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias
        )
