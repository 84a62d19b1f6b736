"""Rotary position embedding (RoPE) in the rotate-half layout of Hugging Face Llama checkpoints.

Supported `rope_type`s: "default", "linear" and "llama3" (Llama 3.1+ frequency scaling).
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq_default(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _inv_freq_llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor = params["factor"]
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramped = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_mid, ramped, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their absolute positions; cos/sin are cached for every position up front."""

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict):
        super().__init__()
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        inv_freq = _inv_freq_default(head_dim, float(rope_parameters.get("rope_theta", 10000.0)))
        if rope_type == "linear":
            inv_freq = inv_freq / rope_parameters["factor"]
        elif rope_type == "llama3":
            inv_freq = _inv_freq_llama3(inv_freq, rope_parameters)
        elif rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Non-persistent buffers: computed here, never loaded from a checkpoint.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] for `positions` [T]: looked up once per step, shared by all layers."""
        return (self.cos_cache[positions].unsqueeze(1).to(dtype),
                self.sin_cache[positions].unsqueeze(1).to(dtype))

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D] and key [T, H_kv, D] for tokens at `positions` [T]."""
        cos, sin = self.cos_sin(positions, query.dtype)
        return rotate(query, cos, sin), rotate(key, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D/2] (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def get_rope(head_dim: int, max_position: int, rope_parameters: dict | None) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, dict(rope_parameters or {}))
