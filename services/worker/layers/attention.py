"""The attention layer models call: the fused q/k/v projection in, attention out, through the
paged KV cache.

The layer owns no cache memory: the model runner binds one cache tensor per layer after it
allocates them, and passes the step's backend metadata to every call.
"""
from __future__ import annotations

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend, AttentionMetadata
from services.worker.layers.layer_ops import LayerOps


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend,
                 ops: LayerOps):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.ops = ops  # the platform's: on a CPU one kernel rotates and writes the cache
        self.kv_cache: torch.Tensor | None = None

    def forward(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """qkv [T, (H + 2 H_kv) D] from the fused projection, `rope` this step's (cos, sin)
        [T, 1, D/2]: rotates q and k, writes k and v into the cache, attends -> [T, H*D]."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("KV cache not initialised: call InitializeKVCache first")
        cos, sin = rope
        q, k, v = self.ops.rope_and_cache(qkv, cos, sin, cache, attn_metadata, self.backend, self.num_heads,
                                          self.num_kv_heads, self.head_dim)
        return self.backend.attend(q, k, v, cache, attn_metadata, self.scale)
