"""prefill_attention (tiled, tensor cores through nvcuda::wmma) executed on the CPU through the
shim's WMMA emulation, against the dense float64 reference (tests/oracles.py): fresh prompts over
several KV blocks, KV tiles and query tiles, chunked prefills that continue mid-block, GQA 1/3/8,
head sizes 64 and 128, bfloat16 and float16; the tile plan; what the wrapper refuses."""
from __future__ import annotations

import pytest
import torch

from services.worker.kernels.prefill_attention_ops import (
    TILE_ROWS,
    plan_prefill_tiles,
    prefill_attention,
    tile_plan_tensor,
)
from tests.kernels.paged_batch import TOLERANCES, PagedBatch, check_batch, make_batch

# (dtype, head_dim, (query heads, KV heads), block_size, requests as (context, query tokens)).
# Each case has a prompt of two or more query tiles over several KV blocks and KV tiles, and a
# chunk whose context ends inside a block.
PREFILL_CASES = {
    # 80 rows: 2 query tiles; 80 keys: 5 blocks, 3 tiles of 32. Contexts 37 (mid-block) and 16.
    "gqa1-d128-bf16": (torch.bfloat16, 128, (2, 2), 16, ((0, 80), (37, 20), (16, 2))),
    # 90 and 72 rows: 2 query tiles each; 69 keys: 2 tiles of 64 over 3 blocks of 32.
    "gqa3-d64-fp16": (torch.float16, 64, (6, 2), 32, ((0, 30), (45, 24), (70, 3))),
    # 96 rows: 2 query tiles; 112 keys: 7 blocks, 2 tiles of 64. Context 100 (mid-block).
    "gqa8-d64-bf16": (torch.bfloat16, 64, (8, 1), 16, ((0, 9), (100, 12))),
    # 136 rows: 3 query tiles of 8 tokens; 46 keys: 3 blocks, 2 tiles of 32. Context 29.
    "gqa8-d128-fp16": (torch.float16, 128, (16, 2), 16, ((0, 5), (29, 17))),
}


def write_cache(batch: PagedBatch) -> torch.Tensor:
    """The cache with this step's K/V at their slots (placed by indexing, not by a kernel)."""
    cache = batch.kv_cache.clone()
    num_kv_heads, head_dim = batch.key.shape[1:]
    slots = batch.common.slot_mapping
    cache[0].view(-1, num_kv_heads, head_dim)[slots] = batch.key
    cache[1].view(-1, num_kv_heads, head_dim)[slots] = batch.value
    return cache


def run_prefill(shim, batch: PagedBatch) -> torch.Tensor:
    num_tokens, num_heads, head_dim = batch.query.shape
    group = num_heads // batch.key.shape[1]
    c = batch.common
    out = torch.full((num_tokens, num_heads * head_dim), float("nan"), dtype=batch.query.dtype)
    plan = tile_plan_tensor(plan_prefill_tiles(c.query_lens_cpu, group), "cpu")
    launch = prefill_attention(out, batch.query, write_cache(batch), c.block_table, c.query_start_loc, c.seq_lens,
                               plan, head_dim**-0.5)
    shim(launch)
    return out


def case_batch(name: str, seed: int = 0) -> PagedBatch:
    dtype, head_dim, heads, block_size, requests = PREFILL_CASES[name]
    return make_batch(*heads, head_dim, dtype, block_size=block_size, requests=requests, seed=seed)


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_attention_matches_dense_reference(shim, name):
    batch = case_batch(name, seed=len(name))
    out = run_prefill(shim, batch)
    check_batch(out, batch, batch.query.shape[2] ** -0.5, TOLERANCES[batch.query.dtype])
    assert shim.launches[-1].startswith("spindle::prefill_attention<")


def test_strided_query_from_a_fused_projection(shim):
    batch = make_batch(6, 2, 64, torch.bfloat16, requests=((3, 40),), fused_qkv=True, seed=9)
    assert not batch.query.is_contiguous()
    check_batch(run_prefill(shim, batch), batch, 0.125, TOLERANCES[torch.bfloat16])


def test_rows_outside_the_plan_are_left_alone(shim):
    """Decode rows (one query token) are not in the plan: their output keeps its NaN filler."""
    batch = make_batch(2, 2, 64, torch.float16, requests=((0, 7), (5, 1), (3, 4)), seed=4)
    out = run_prefill(shim, batch)
    assert out[7].isnan().all() and not out[:7].isnan().any() and not out[8:].isnan().any()


def test_tile_plan():
    assert plan_prefill_tiles([1, 80, 2, 1], group=1) == [(1, 0), (1, TILE_ROWS), (2, 0)]
    assert plan_prefill_tiles([24], group=3) == [(0, 0), (0, 64)]  # 72 packed rows
    assert plan_prefill_tiles([1, 1], group=8) == []
    plan = tile_plan_tensor([(0, 0), (3, 64)], "cpu")
    assert plan.dtype == torch.int32 and plan.tolist() == [[0, 0], [3, 64]]
    assert tile_plan_tensor([], "cpu").shape == (0, 2)


@pytest.mark.parametrize("bad", ("float32", "head_dim", "gqa", "plan_dtype", "unaligned_query"))
def test_wrapper_rejects_what_the_kernel_cannot_read(bad):
    dtype = torch.float32 if bad == "float32" else torch.bfloat16
    batch = make_batch(4, 2, 64, dtype, requests=((0, 4),))
    c = batch.common
    query, cache = batch.query, batch.kv_cache
    plan = tile_plan_tensor(plan_prefill_tiles(c.query_lens_cpu, 2), "cpu")
    if bad == "head_dim":
        query, cache = query[..., :32], cache[..., :32].contiguous()
    elif bad == "gqa":
        query = torch.cat([query, query[:, :1]], dim=1)  # 5 query heads over 2 KV heads
    elif bad == "plan_dtype":
        plan = plan.long()
    elif bad == "unaligned_query":
        query = torch.empty(query.numel() + 1, dtype=dtype)[1:].view(query.shape)
    out = torch.empty(query.shape[0], query.shape[1] * query.shape[2], dtype=dtype)
    with pytest.raises(ValueError):
        prefill_attention(out, query, cache, c.block_table, c.query_start_loc, c.seq_lens, plan, 0.125)
