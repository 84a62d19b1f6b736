"""Random paged-attention batches for the kernel tests: ragged contexts, scattered blocks."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from services.worker.attention.backend import CommonAttentionMetadata

# (tokens already in the cache, tokens this step): a fresh prefill, decodes at context 0 and 1,
# a chunked prefill, decodes past one and several partitions of 128 keys.
DEFAULT_REQUESTS = ((0, 5), (0, 1), (1, 1), (20, 9), (37, 1), (300, 1))


@dataclass
class PagedBatch:
    common: CommonAttentionMetadata
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, H_kv, D] this step's keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, H_kv, D] with earlier context filled in
    max_seq_len: int


def make_batch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16,
               requests=DEFAULT_REQUESTS, seed: int = 0, fused_qkv: bool = False) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = sum(-(-(c + n) // block_size) for c, n in requests)
    num_blocks = needed + 7
    free = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(free)  # scattered: no request owns consecutive blocks
    tables, slots, query_lens, seq_lens = [], [], [], []
    for context, new in requests:
        blocks = [free.pop() for _ in range(-(-(context + new) // block_size))]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(context, context + new)]
        query_lens.append(new)
        seq_lens.append(context + new)
    width = max(map(len, tables)) + 2  # padded with the null block, as the runner does
    block_table = torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int64)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    kv_cache[:, 0] = 0  # the null block holds finite values
    num_tokens = sum(query_lens)
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
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=block_table,
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(common, query, key, value, kv_cache, max(seq_lens))


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The PyTorch backend (the CPU path) on float32 copies of the inputs: the oracle."""
    from services.worker.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    cache = batch.kv_cache.float().clone()
    return backend.forward(batch.query.float(), batch.key.float(), batch.value.float(), cache,
                           backend.build_metadata(batch.common), scale)


# Kernel output (accumulated in float32, rounded once) against the float32 oracle.
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
