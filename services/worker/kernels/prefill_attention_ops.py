"""Wrappers for tiled prefill attention (prefill_attention.cu): the tile plan and the launch.

A request with more than one query token is a prefill row set; its query rows are packed by KV
head group (row = token * group + head in the group) and cut into tiles of `TILE_ROWS`, one CTA
per (tile, KV head). `plan_prefill_tiles` lists the tiles on the host, once per step;
`prefill_attention` validates the tensors and returns the launch. Decode rows (one query token)
are left to `attention_ops.paged_attention`, and float32 (no float32 m16n16k16 tensor-core shape)
stays there entirely.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.kernels.launch import CUDA_TYPE_NAMES, KernelLaunch, check_tensor, f32, i32, i64
from services.worker.kernels.loader import HEAD_DIMS, PREFILL_DTYPES

TILE_ROWS = 64  # packed query rows per CTA (prefill_attention.cu: kTileRows)


def is_prefill(query_len: int) -> bool:
    """Rows of a request with more than one query token go to the prefill kernel."""
    return query_len > 1


def plan_prefill_tiles(query_lens: Sequence[int], group: int) -> list[tuple[int, int]]:
    """(request index, first packed row) of every tile: request r with query_lens[r] > 1 has
    query_lens[r] * group packed rows, cut into ceil(rows / TILE_ROWS) tiles."""
    return [(r, row) for r, n in enumerate(query_lens) if is_prefill(n) for row in range(0, n * group, TILE_ROWS)]


def tile_plan_tensor(tiles: Sequence[tuple[int, int]], device: torch.device | str) -> torch.Tensor:
    """The plan as the kernel reads it: int32 [num_tiles, 2]."""
    return torch.tensor(tiles, dtype=torch.int32).view(-1, 2).to(device)


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_plan: torch.Tensor,
    scale: float,
) -> KernelLaunch | None:
    """Causal attention of the query rows the tile plan covers, over their requests' cached K/V.

    Same conventions as `paged_attention`: token t of request r sits at position
    seq_lens[r] - query_len(r) + (t - query_start_loc[r]), sees cache positions 0..position
    through block_table[r], and the cache already holds this step's K/V. Writes the covered rows
    of `out` [T, H * D] (or [T, H, D]) in the query's dtype and leaves the others alone. bfloat16
    and float16 only; query and out rows must be 16-byte aligned (16-byte loads and stores).
    Returns None when the plan is empty.
    """
    dtype = kv_cache.dtype
    check_tensor("kv_cache", kv_cache, PREFILL_DTYPES, ndim=5, aligned=True)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_tensor("query", query, dtype, ndim=3, contiguous=False, inner_contiguous=True, aligned=True)
    num_tokens, num_heads, _ = query.shape
    if head_dim not in HEAD_DIMS or query.shape[2] != head_dim:
        raise ValueError(f"head_dim {head_dim} (query {query.shape[2]}): kernels exist for {HEAD_DIMS}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    check_tensor("out", out, dtype, contiguous=False, inner_contiguous=True, aligned=True)
    if out.shape[0] != num_tokens or out[0].numel() != num_heads * head_dim:
        raise ValueError(f"out: shape {tuple(out.shape)}, expected [{num_tokens}, {num_heads * head_dim}]")
    check_tensor("block_table", block_table, torch.int64, ndim=2)
    check_tensor("query_start_loc", query_start_loc, torch.int64, ndim=1)
    check_tensor("seq_lens", seq_lens, torch.int64, ndim=1)
    check_tensor("tile_plan", tile_plan, torch.int32, ndim=2)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] != num_reqs:
        raise ValueError("query_start_loc, seq_lens and block_table disagree on the number of requests")
    if tile_plan.shape[1] != 2:
        raise ValueError(f"tile_plan: shape {tuple(tile_plan.shape)}, expected [num_tiles, 2]")
    num_tiles = tile_plan.shape[0]
    if num_tiles == 0:
        return None
    return KernelLaunch(
        module="prefill_attention",
        name=f"spindle::prefill_attention<{CUDA_TYPE_NAMES[dtype]}, {head_dim}>",
        grid=(num_tiles, num_kv_heads, 1),
        block=(128, 1, 1),
        args=(out, i64(out.stride(0)), query, i64(query.stride(0)), kv_cache, block_table,
              i32(block_table.stride(0)), query_start_loc, seq_lens, tile_plan, i32(num_heads),
              i32(num_kv_heads), i32(block_size), i64(num_blocks * block_size), f32(scale)),
    )
