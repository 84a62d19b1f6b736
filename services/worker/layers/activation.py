"""Gated activations on a fused [gate | up] projection."""
from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.layer_ops import LayerOps


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] along the last dimension (Llama's SwiGLU MLP)."""

    def __init__(self, ops: LayerOps):
        super().__init__()
        self.ops = ops  # the platform's: compiled kernels on a CPU, else PyTorch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


_ACTIVATIONS = {"silu": SiluAndMul}


def get_act_and_mul(name: str, ops: LayerOps) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name](ops)
