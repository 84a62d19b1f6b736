"""Fused CPU layers from the compiled library (csrc/fused_ops.c): residual add + RMSNorm, RMSNorm,
SiLU-and-mul, and RoPE + KV cache write, each one call where PyTorch runs 3-12 operations and as
many passes over the rows.

`FusedOps` binds the kernels; `CpuLayerOps` is the CPU platform's `LayerOps`: the kernels where
they apply, the PyTorch reference (`TorchLayerOps`) for any tensor `supports` refuses (another
dtype or device) and for bfloat16 SiLU-and-mul where the build lacks AVX512_BF16 rounding.
"""
from __future__ import annotations

import ctypes

import torch

from services.worker.attention.backend import AttentionBackend, AttentionMetadata
from services.worker.layers.layer_ops import LayerOps, TorchLayerOps

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class FusedOps:
    def __init__(self, library: ctypes.CDLL):
        self._add_rms_norm, self._rms_norm, self._silu_and_mul, self._rope_cache = {}, {}, {}, {}
        for dtype, suffix in _SUFFIXES.items():
            self._rope_cache[dtype] = _bind(library, f"rope_cache_{suffix}", [_P] * 6 + [_I64] * 4)
            self._add_rms_norm[dtype] = _bind(library, f"add_rms_norm_{suffix}", [_P, _P, _P, _I64, _I64, _F32])
            self._rms_norm[dtype] = _bind(library, f"rms_norm_{suffix}", [_P, _P, _P, _I64, _I64, _F32])
            self._silu_and_mul[dtype] = _bind(library, f"silu_and_mul_{suffix}", [_P, _P, _I64, _I64])
        native = _bind(library, "silu_and_mul_bf16_native", [])
        native.restype = ctypes.c_int
        self.has_native_bf16_silu = bool(native())

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _SUFFIXES and x.dim() == 2 and x.is_contiguous()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._rms_norm[x.dtype](x.data_ptr(), out.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual += x, x = rms_norm(residual) * weight; returns (x, residual)."""
        self._add_rms_norm[x.dtype](x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
                                    eps)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, width = x.shape
        out = torch.empty(num_tokens, width // 2, dtype=x.dtype)
        self._silu_and_mul[x.dtype](x.data_ptr(), out.data_ptr(), num_tokens, width // 2)
        return out

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int) -> None:
        """In place: rotates the q and k heads of `qkv` as `rope_and_cache` does, writing no cache."""
        if not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope needs contiguous cos and sin")
        self._rope_cache[qkv.dtype](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), None, None, None, qkv.shape[0],
                                    num_heads, num_kv_heads, head_dim)

    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """In place: rotates the q and k heads of `qkv` [T, (H + 2 H_kv) D] by cos/sin [T, ..., D/2]
        and writes k and v into `kv_cache` [2, num_blocks, block_size, H_kv, D] at `slot_mapping`."""
        if not (cos.is_contiguous() and sin.is_contiguous() and kv_cache.is_contiguous()
                and slot_mapping.is_contiguous() and slot_mapping.dtype == torch.int64):
            raise ValueError("rope_and_cache needs contiguous cos, sin, cache and an int64 slot mapping")
        value_cache_ptr = kv_cache.data_ptr() + kv_cache.stride(0) * kv_cache.itemsize  # kv_cache[1], no view
        self._rope_cache[qkv.dtype](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                                    kv_cache.data_ptr(), value_cache_ptr, qkv.shape[0], num_heads, num_kv_heads,
                                    head_dim)


def _bind(library: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    function = getattr(library, name)
    function.argtypes, function.restype = argtypes, None
    return function


class CpuLayerOps(LayerOps):
    """The compiled kernels where they apply, else PyTorch. The fused RoPE + cache write assumes the
    cache layout and slot mapping every CPU backend uses (attention/backend.py), so it stands in
    for their `write_kv`."""

    def __init__(self, fused: FusedOps):
        self.fused = fused
        self.reference = TorchLayerOps()

    def rms_norm(self, x, weight, eps):
        if self.fused.supports(x) and x.dtype == weight.dtype:
            return self.fused.rms_norm(x, weight, eps)
        return self.reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if self.fused.supports(x) and x.dtype == weight.dtype and self.fused.supports(residual) \
                and residual.dtype == x.dtype:
            return self.fused.add_rms_norm(x, residual, weight, eps)
        return self.reference.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        # bfloat16 takes the fused kernel where it rounds with VCVTNEPS2BF16: 1.3-1.5x PyTorch's op
        # (Zen 4, two threads: 40 rows 21 vs 30 us, 2,048 rows 0.99 vs 1.45 ms); elsewhere the two are
        # level, so PyTorch keeps it. For float32 the fused one wins (2,048 rows: 1.5 vs 2.5 ms).
        if (x.dtype == torch.float32 or self.fused.has_native_bf16_silu) and self.fused.supports(x):
            return self.fused.silu_and_mul(x)
        return self.reference.silu_and_mul(x)

    def rope_and_cache(self, qkv, cos, sin, kv_cache, attn_metadata: AttentionMetadata, backend: AttentionBackend,
                       num_heads, num_kv_heads, head_dim):
        if not (self.fused.supports(qkv) and qkv.dtype == cos.dtype == sin.dtype):
            return self.reference.rope_and_cache(qkv, cos, sin, kv_cache, attn_metadata, backend, num_heads,
                                                 num_kv_heads, head_dim)
        num_tokens, q_width, kv_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_width].view(num_tokens, num_heads, head_dim)
        k = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_width + kv_width :].view(num_tokens, num_kv_heads, head_dim)
        if kv_cache.dtype != qkv.dtype:  # a cache of its own format (int8): its backend writes it
            self.fused.rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
            backend.write_kv(k, v, kv_cache, attn_metadata)
        else:  # one kernel rotates q and k in place and writes k and v into the cache
            self.fused.rope_and_cache(qkv, cos, sin, attn_metadata.slot_mapping, kv_cache, num_heads, num_kv_heads,
                                      head_dim)
        return q, k, v
