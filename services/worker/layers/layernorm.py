"""RMS normalisation, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.layer_ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: LayerOps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.ops = ops  # the platform's: compiled kernels on a CPU, else PyTorch

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns norm(x), or with `residual`: (norm(x + residual), x + residual). With a residual
        the op may work in place: `x` and `residual` may be overwritten with those two results."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
