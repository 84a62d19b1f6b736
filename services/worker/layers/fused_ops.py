"""Fused CPU layers from the compiled library (csrc/fused_ops.c): residual add + RMSNorm, RMSNorm,
SiLU-and-mul, and RoPE + KV cache write, each one call where PyTorch runs 3-12 operations and as
many passes over the rows.

`use_fused_ops(model, ops)` hands them to the model's RMSNorm, SiluAndMul and Attention modules,
which fall back to their PyTorch code for any tensor `supports` refuses (another dtype or device).
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

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


def use_fused_ops(model: nn.Module, ops: FusedOps) -> int:
    """Gives `ops` to every module that can use them; returns how many took them."""
    num_modules = 0
    for module in model.modules():
        if hasattr(module, "fused_ops"):
            module.fused_ops = ops
            num_modules += 1
    return num_modules
