"""The compiled CPU decode-attention kernel (csrc/paged_decode.c): argument checks and the call.

The library is built and loaded by services/worker/cpu_kernels.py; without it the PyTorch path
stays in use.
"""
from __future__ import annotations

import ctypes

import torch

MAX_HEAD_DIM = 256  # and a multiple of 8 (csrc/paged_decode.c)
MAX_GROUP = 16  # query heads per KV head
_SUPPORTED = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _P, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32, _F32, _I64, _P, _I32]


class PagedDecodeKernel:
    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, name in _SUPPORTED.items():
            function = getattr(library, name)
            function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
            self._functions[dtype] = function
        self._scratch_floats = library.scratch_floats_per_thread
        self._scratch_floats.argtypes, self._scratch_floats.restype = [_I64, _I32, _I32], _I64

    def supports(self, cache_dtype: torch.dtype, head_dim: int, num_heads: int = 1, num_kv_heads: int = 1) -> bool:
        return (cache_dtype in self._functions and 0 < head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
        """query [B, H, D] (any float dtype), caches [num_blocks, bs, H_kv, D], block_table [B, n]
        and seq_lens [B] int64 -> attention output [B, H, D] float32."""
        num_reqs, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("paged decode kernel needs contiguous caches")
        query = query.float().contiguous()
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = torch.empty_like(query)
        num_threads = torch.get_num_threads()
        group = num_heads // max(num_kv_heads, 1)
        scratch = torch.empty(num_threads * self._scratch_floats(max(max_seq_len, 1), group, head_dim),
                              dtype=torch.float32)
        status = self._functions[key_cache.dtype](
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
            block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads, num_kv_heads,
            head_dim, block_size, scale, max_seq_len, scratch.data_ptr(), num_threads,
        )
        if status == 1:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        if status == 3:
            raise ValueError(f"{num_heads // num_kv_heads} query heads per KV head: at most {MAX_GROUP} supported")
        if status:
            raise ValueError(f"head_dim {head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}")
        return out

