"""Wrappers for paged attention (attention.cu): planning the split and launching.

`plan_partitions` decides whether long contexts are split across CTAs (split-K, flash-decoding);
`paged_attention` validates and returns the launches: the attention kernel, plus the combine
kernel when split.
"""
from __future__ import annotations

import torch

from services.worker.kernels.launch import CUDA_TYPE_NAMES, KernelLaunch, check_tensor, f32, i32, i64
from services.worker.kernels.loader import GROUP_TILES, HEAD_DIMS

PARTITION_SIZE = 512  # keys per split-K partition: 4 tiles of 128


def group_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per CTA: the GQA group rounded up to an instantiated size, at most 8."""
    group = num_heads // num_kv_heads
    return next(g for g in GROUP_TILES if g >= min(group, GROUP_TILES[-1]))


def plan_partitions(max_seq_len: int, num_ctas: int, num_sms: int, partition_size: int = PARTITION_SIZE) -> int:
    """Number of split-K partitions: 1 unless contexts are long and the grid alone would leave
    SMs short of work (fewer than 4 CTAs per SM)."""
    if max_seq_len <= partition_size or num_ctas >= 4 * num_sms:
        return 1
    return -(-max_seq_len // partition_size)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_partitions: int = 1,
) -> list[KernelLaunch]:
    """Causal attention of every query token [T, H, D] over its request's cached keys/values.

    Token t of request r (rows query_start_loc[r]:query_start_loc[r+1]) sits at position
    seq_lens[r] - query_len(r) + (t - query_start_loc[r]) and sees cache positions 0..position,
    read through block_table[r]; the cache must already hold this step's K/V. Writes `out`
    [T, H * D] (or [T, H, D]) in the query's dtype. With `num_partitions` > 1 the keys up to
    `max_seq_len` (the longest of seq_lens, known on the host) are split in that many partitions,
    each a whole number of 128-key tiles.
    """
    dtype = kv_cache.dtype
    check_tensor("kv_cache", kv_cache, tuple(CUDA_TYPE_NAMES), ndim=5, aligned=True)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_tensor("query", query, dtype, ndim=3, contiguous=False, inner_contiguous=True)
    num_tokens, num_heads, _ = query.shape
    if head_dim not in HEAD_DIMS or query.shape[2] != head_dim:
        raise ValueError(f"head_dim {head_dim} (query {query.shape[2]}): kernels exist for {HEAD_DIMS}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    check_tensor("out", out, dtype, contiguous=False, inner_contiguous=True)
    if out.shape[0] != num_tokens or out[0].numel() != num_heads * head_dim:
        raise ValueError(f"out: shape {tuple(out.shape)}, expected [{num_tokens}, {num_heads * head_dim}]")
    check_tensor("block_table", block_table, torch.int64, ndim=2)
    check_tensor("query_start_loc", query_start_loc, torch.int64, ndim=1)
    check_tensor("seq_lens", seq_lens, torch.int64, ndim=1)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] != num_reqs:
        raise ValueError("query_start_loc, seq_lens and block_table disagree on the number of requests")
    if num_tokens == 0:
        return []
    tile = group_tile(num_heads, num_kv_heads)
    num_chunks = -(-(num_heads // num_kv_heads) // tile)
    split = num_partitions > 1
    partition_size = -(-max(1, max_seq_len) // (num_partitions * 128)) * 128
    part_out = part_ml = torch.empty(0, dtype=torch.float32, device=query.device)
    if split:
        part_out = torch.empty(num_tokens, num_heads, num_partitions, head_dim, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_tokens, num_heads, num_partitions, 2, dtype=torch.float32, device=query.device)
    type_name = CUDA_TYPE_NAMES[dtype]
    attention = KernelLaunch(
        module="attention",
        name=f"spindle::paged_attention<{type_name}, {head_dim}, {tile}>",
        grid=(num_tokens, num_kv_heads * num_chunks, num_partitions),
        block=(128, 1, 1),
        args=(out, i64(out.stride(0)), part_out, part_ml, query, i64(query.stride(0)), kv_cache,
              block_table, i32(block_table.stride(0)), query_start_loc, seq_lens,
              i32(num_reqs), i32(num_heads), i32(num_kv_heads), i32(block_size), i64(num_blocks * block_size),
              i32(partition_size if split else 2**30), i32(num_partitions), f32(scale)),
    )
    if not split:
        return [attention]
    combine = KernelLaunch(
        module="attention",
        name=f"spindle::paged_attention_combine<{type_name}, {head_dim}>",
        grid=(num_tokens, num_heads, 1),
        block=(head_dim, 1, 1),
        args=(out, i64(out.stride(0)), part_out, part_ml, query_start_loc, seq_lens,
              i32(num_reqs), i32(num_heads), i32(partition_size), i32(num_partitions)),
    )
    return [attention, combine]
