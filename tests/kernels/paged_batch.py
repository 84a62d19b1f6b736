"""Random paged-attention batches: ragged contexts, scattered blocks, and each request's dense
K/V history kept alongside the cache for the float64 reference (tests/oracles.py).

The context's K/V is placed in the cache position by position from the dense history, by this
module's own loop; the reference reads the dense history, never the cache. Every slot that no
request owns (other blocks, the tail of a request's last block) holds random values, so a kernel
reading the wrong block or past a sequence's end is off.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from services.worker.attention.backend import CommonAttentionMetadata
from tests.oracles import DenseRequest, batch_dense_attention, check_attention

# (tokens already in the cache, tokens this step): a fresh prefill, decodes at context 0 and 1,
# a chunked prefill, a decode, a prefill over several blocks, a chunked prefill whose context and
# queries both cross block boundaries, and a decode past two 128-key tiles.
DEFAULT_REQUESTS = ((0, 5), (0, 1), (1, 1), (20, 9), (37, 1), (0, 40), (45, 24), (300, 1))


@dataclass
class PagedBatch:
    common: CommonAttentionMetadata
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, H_kv, D] this step's keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, H_kv, D] with earlier context filled in
    max_seq_len: int
    dense: tuple[DenseRequest, ...]  # per request: its whole history, as generated
    tables: list[list[int]]  # per request: its block ids (room for `reserve` more tokens)


def _place(cache: torch.Tensor, blocks: list[int], block_size: int, start: int, keys, values) -> None:
    for j in range(keys.shape[0]):
        pos = start + j
        cache[0, blocks[pos // block_size], pos % block_size] = keys[j]
        cache[1, blocks[pos // block_size], pos % block_size] = values[j]


def _common(tables, block_size, contexts, query_lens) -> CommonAttentionMetadata:
    slots = []
    for blocks, context, n in zip(tables, contexts, query_lens):
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(context, context + n)]
    seq_lens = [c + n for c, n in zip(contexts, query_lens)]
    width = max(map(len, tables)) + 2  # padded with the null block, as the runner does
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + list(query_lens)).cumsum(0),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int64),
        block_size=block_size,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )


def make_batch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16,
               requests=DEFAULT_REQUESTS, seed: int = 0, fused_qkv: bool = False, reserve: int = 0) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [-(-(c + n + reserve) // block_size) for c, n in requests]
    num_blocks = sum(needed) + 7
    free = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(free)  # scattered: no request owns consecutive blocks
    tables = [[free.pop() for _ in range(k)] for k in needed]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    kv_cache[:, 0] = 0  # the null block holds finite values
    num_tokens = sum(n for _, n in requests)
    if fused_qkv:  # q/k/v as strided views of one projection output, as the model produces them
        width = (num_heads + 2 * num_kv_heads) * head_dim
        qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
        query = q.view(num_tokens, num_heads, head_dim)
        key = k.view(num_tokens, num_kv_heads, head_dim)
        value = v.view(num_tokens, num_kv_heads, head_dim)
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    dense, start = [], 0
    for (context, n), blocks in zip(requests, tables):
        # Rounded to the cache dtype first: the reference sees exactly the values the kernel reads.
        ctx_k = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
        ctx_v = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
        _place(kv_cache, blocks, block_size, 0, ctx_k, ctx_v)
        dense.append(DenseRequest(torch.cat([ctx_k, key[start:start + n]]),
                                  torch.cat([ctx_v, value[start:start + n]]), n))
        start += n
    common = _common(tables, block_size, [c for c, _ in requests], [n for _, n in requests])
    return PagedBatch(common, query, key, value, kv_cache, max(common.seq_lens_cpu), tuple(dense), tables)


def decode_step_after(batch: PagedBatch, seed: int = 1) -> PagedBatch:
    """The next step: one more token for every request (built with `reserve` >= 1). Its kv_cache
    is the earlier one; pass the cache the code under test wrote in the first step instead."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(batch.dense)
    num_heads, head_dim = batch.query.shape[1:]
    num_kv_heads = batch.key.shape[1]
    dtype = batch.query.dtype
    query = torch.randn(num_reqs, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_reqs, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_reqs, num_kv_heads, head_dim, generator=gen).to(dtype)
    dense = tuple(DenseRequest(torch.cat([r.keys, key[i:i + 1]]), torch.cat([r.values, value[i:i + 1]]), 1)
                  for i, r in enumerate(batch.dense))
    contexts = [r.keys.shape[0] for r in batch.dense]
    bs = batch.common.block_size
    assert all(c < len(t) * bs for c, t in zip(contexts, batch.tables)), "make_batch(reserve=1) leaves room"
    common = _common(batch.tables, bs, contexts, [1] * num_reqs)
    return PagedBatch(common, query, key, value, batch.kv_cache, max(common.seq_lens_cpu), dense, batch.tables)


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The dense float64 reference over the batch's generated histories: [T, H * D] float64."""
    return batch_dense_attention(batch.query, batch.dense, scale)


def check_batch(out: torch.Tensor, batch: PagedBatch, scale: float, tol: float, **kwargs) -> None:
    check_attention(out, batch.query, batch.dense, scale, tol, **kwargs)


# Kernel output (accumulated in float32, rounded once to the output dtype) against the float64
# reference on the same rounded inputs, as atol = rtol (outputs are of order 1): float32 differs by
# accumulation order only (seen on the shim: 1.4e-6; the float32 bound leaves room for the GPU
# build's fast-math expf, as tests/gpu runs these bodies); bfloat16 and float16 outputs carry one
# rounding of 2^-9 and 2^-12 relative plus float32 sums of bf16/fp16 products (seen: 2.6e-3, 3.2e-4).
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1.5e-3}
