"""The compiled CPU decode-attention kernel for the int8 KV cache (csrc/paged_decode_int8.c):
argument checks and the call. The cache layout is attention/int8_kv_cache.py's.

The library is built and loaded by services/worker/cpu_kernels.py.
"""
from __future__ import annotations

import ctypes

import torch

from services.worker.attention.int8_kv_cache import int8_block_bytes

MAX_HEAD_DIM = 256  # and a multiple of 8 (csrc/decode_common.h)
MAX_GROUP = 16  # query heads per KV head
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _I64, _P, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32, _F32, _I64, _P, _I32]


class PagedDecodeInt8Kernel:
    def __init__(self, library: ctypes.CDLL):
        self._function = library.paged_decode_int8
        self._function.argtypes, self._function.restype = _ARGTYPES, ctypes.c_int
        self._scratch_floats = library.scratch_floats_per_thread  # the need of both decode kernels
        self._scratch_floats.argtypes, self._scratch_floats.restype = [_I64, _I32, _I32], _I64
        # head sizes that are a multiple of 64 multiply on VDPBF16PS (query and weights rounded to
        # bfloat16), else float32 throughout
        self.has_bf16_dot = bool(library.paged_decode_int8_has_bf16_dot())

    def supports(self, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
        return (0 < head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0 and num_kv_heads > 0
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float, block_size: int,
                 num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """query [B, H, D] (any float dtype), the key and value halves of a layer's int8 cache, each
        [num_blocks, block_bytes], block_table [B, n] and seq_lens [B] int64 -> attention output
        [B, H, D] float32.

        max_seq_len must be at least every seq_len (it sizes the scratch) and every block id the
        first seq_len tokens of a row reach must lie in the cache: neither is checked here."""
        if query.dim() != 3 or query.shape[2] != head_dim or not query.is_floating_point():
            raise ValueError(f"query must be a float [B, H, {head_dim}] tensor, not {query.dtype} {tuple(query.shape)}")
        num_reqs, num_heads, _ = query.shape
        if not self.supports(head_dim, num_heads, num_kv_heads):
            raise ValueError(f"int8 decode kernel: {num_heads} query heads over {num_kv_heads} KV heads of {head_dim} "
                             f"(needs a whole group of at most {MAX_GROUP}, head_dim a multiple of 8 up to "
                             f"{MAX_HEAD_DIM})")
        expected_bytes = int8_block_bytes(block_size, num_kv_heads, head_dim)
        for cache in (key_cache, value_cache):
            if (block_size <= 0 or cache.dtype != torch.int8 or cache.dim() != 2 or not cache.is_contiguous()
                    or cache.shape != (key_cache.shape[0], expected_bytes)):
                raise ValueError(f"not a contiguous int8 [num_blocks, {expected_bytes}] cache half of {block_size}-"
                                 f"token blocks for {num_kv_heads} KV heads of {head_dim}: {cache.dtype} "
                                 f"{tuple(cache.shape)}{'' if cache.is_contiguous() else ' non-contiguous'}")
        if block_table.dtype != torch.int64 or block_table.dim() != 2 or block_table.shape[0] != num_reqs:
            raise ValueError(f"block table must be int64 [{num_reqs}, n], not {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        if seq_lens.dtype != torch.int64 or seq_lens.shape != (num_reqs,):
            raise ValueError(f"seq_lens must be int64 [{num_reqs}], not {seq_lens.dtype} {tuple(seq_lens.shape)}")
        query = query.float().contiguous()
        block_table = block_table.contiguous()
        seq_lens = seq_lens.contiguous()
        out = torch.empty_like(query)
        num_threads = torch.get_num_threads()
        scratch = torch.empty(num_threads * self._scratch_floats(max(max_seq_len, 1), num_heads // num_kv_heads,
                                                                 head_dim), dtype=torch.float32)
        status = self._function(
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), expected_bytes,
            block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_reqs,
            num_heads, num_kv_heads, head_dim, block_size, scale, max_seq_len, scratch.data_ptr(), num_threads,
        )
        if status:  # the checks above cover every status; a nonzero one is a bug in them
            raise RuntimeError(f"paged_decode_int8 returned status {status}")
        return out
