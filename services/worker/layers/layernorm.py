"""RMS normalisation, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.fused_ops = None  # the compiled CPU kernels (layers/fused_ops.py), when the worker has them

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the model dtype: bf16 sums of squares lose too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns norm(x), or with `residual`: (norm(x + residual), x + residual). The fused kernel
        works in place: `x` and `residual` are overwritten with those two results."""
        ops = self.fused_ops
        if ops is not None and ops.supports(x) and x.dtype == self.weight.dtype:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if ops.supports(residual) and residual.dtype == x.dtype:
                return ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
