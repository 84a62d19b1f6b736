"""Wrapper for `reshape_and_cache` (cache.cu): this step's K/V into the paged cache."""
from __future__ import annotations

import torch

from services.worker.kernels.launch import CUDA_TYPE_NAMES, KernelLaunch, check_tensor, i32, i64


def reshape_and_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> KernelLaunch | None:
    """Writes key/value [T, H_kv, D] (rows may be strided, e.g. views of a fused qkv output) to
    `kv_cache` [2, num_blocks, block_size, H_kv, D] at `slot_mapping` [T] (int64; -1 skips).
    Returns None when there is nothing to write."""
    dtype = kv_cache.dtype
    check_tensor("kv_cache", kv_cache, tuple(CUDA_TYPE_NAMES), ndim=5, aligned=True)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, dtype, ndim=3, contiguous=False, inner_contiguous=True, aligned=True)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [T, {num_kv_heads}, {head_dim}]")
    check_tensor("slot_mapping", slot_mapping, torch.int64, ndim=1)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError("key, value and slot_mapping disagree on the number of tokens")
    row_elems = num_kv_heads * head_dim
    if (row_elems * kv_cache.element_size()) % 16:
        raise ValueError("a cache row must be a multiple of 16 bytes")
    if num_tokens == 0:
        return None
    num_chunks = row_elems * kv_cache.element_size() // 16
    threads = min(256, max(32, -(-num_chunks // 32) * 32))
    return KernelLaunch(
        module="cache",
        name=f"spindle::reshape_and_cache<{CUDA_TYPE_NAMES[dtype]}>",
        grid=(num_tokens, 1, 1),
        block=(threads, 1, 1),
        args=(kv_cache, key, value, slot_mapping, i64(num_blocks * block_size), i32(row_elems),
              i64(key.stride(0)), i64(value.stride(0))),
    )
