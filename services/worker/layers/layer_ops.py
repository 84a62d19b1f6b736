"""The per-token computations a platform may run in its own kernels: RMSNorm (with the residual
add before it), SiLU-and-mul, and RoPE with the KV cache write.

Layers get a `LayerOps` at construction (from the worker's platform) and always call it;
`TorchLayerOps` is the PyTorch code every other implementation must match, and the path for any
tensor another implementation does not take.
"""
from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend, AttentionMetadata
from services.worker.layers.rotary_embedding import rotate


class LayerOps(abc.ABC):
    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x) over the last dimension, statistics in float32; `x` is left alone."""

    @abc.abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual). May work in place: the caller must not read
        `x` or `residual` afterwards except through the results."""

    @abc.abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x = [gate | up] along the last dimension."""

    @abc.abstractmethod
    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                       attn_metadata: AttentionMetadata, backend: AttentionBackend, num_heads: int,
                       num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the fused projection `qkv` [T, (H + 2 H_kv) D]: rotates q and k by cos/sin
        [T, 1, D/2] (rotate-half layout), has this step's k and v written into `kv_cache` as
        `backend.write_kv` writes them, and returns q [T, H, D], k and v [T, H_kv, D] for
        `backend.attend`. May rotate in place in `qkv`."""


class TorchLayerOps(LayerOps):
    """The PyTorch reference of every op; the KV cache is written by the attention backend."""

    def rms_norm(self, x, weight, eps):
        # Statistics in float32 whatever the model dtype: bf16 sums of squares lose too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps):
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_and_cache(self, qkv, cos, sin, kv_cache, attn_metadata, backend, num_heads, num_kv_heads, head_dim):
        num_tokens, num_qk_heads = qkv.shape[0], num_heads + num_kv_heads
        # q and k sit side by side in the fused output: rotate them in one pass.
        qk = rotate(qkv[:, : num_qk_heads * head_dim].view(num_tokens, num_qk_heads, head_dim), cos, sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, num_qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        backend.write_kv(k, v, kv_cache, attn_metadata)
        return q, k, v
