"""The attention layer models call: q/k/v in, attention out, through the paged KV cache.

The layer owns no cache memory: the model runner binds one cache tensor per layer after it
allocates them, and passes the step's backend metadata to every call.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        self.fused_ops = None  # the compiled CPU kernels (layers/fused_ops.py), when the worker has them

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """q [T, H*D], k and v [T, H_kv*D] (or already split into heads) -> [T, H*D]."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not initialised: call InitializeKVCache first")
        num_tokens = q.shape[0]
        return self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            self.scale,
        )

    def forward_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    attn_metadata: Any) -> torch.Tensor | None:
        """The fused CPU path from the qkv projection [T, (H + 2 H_kv) D]: one kernel rotates q and
        k in place and writes k and v into the cache, then the backend attends over the cache.
        None where it does not apply (no kernels, another dtype, a backend that writes its own
        cache); the caller then rotates and calls `forward`."""
        ops, cache, (cos, sin) = self.fused_ops, self.kv_cache, rope
        attend = getattr(self.backend, "attend", None)
        if ops is None or attend is None or cache is None or not ops.supports(qkv) or \
                not (qkv.dtype == cache.dtype == cos.dtype == sin.dtype):
            return None
        ops.rope_and_cache(qkv, cos, sin, attn_metadata.slot_mapping, cache, self.num_heads, self.num_kv_heads,
                           self.head_dim)
        num_tokens, q_width = qkv.shape[0], self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return attend(
            qkv[:, :q_width].view(num_tokens, self.num_heads, self.head_dim),
            qkv[:, q_width : q_width + kv_width].view(num_tokens, self.num_kv_heads, self.head_dim),
            qkv[:, q_width + kv_width :].view(num_tokens, self.num_kv_heads, self.head_dim),
            cache,
            attn_metadata,
            self.scale,
        )
