"""Attention on the AMX tile unit (csrc/paged_decode_amx.c, csrc/paged_prefill_amx.h) against the
AVX-512 / vector kernels and a float64 reference where the CPU has AMX-BF16; on every machine the
switch, the shapes that stay on the vector kernels, and the platform's flag."""
from __future__ import annotations

import pytest
import torch

from services.worker import cpu_kernels
from services.worker.attention.amx_attention import amx_attention_in_use, use_amx_attention
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.cpu_prefill import PagedPrefillKernel, PrefillSlices
from services.worker.config import WorkerConfig, cpu_has_amx_bf16
from services.worker.platforms import AttentionHeads, build_platform

SCALE = 0.125


@pytest.fixture(scope="module")
def cache_dir(kernel_cache):
    return kernel_cache


@pytest.fixture(scope="module")
def library(cache_dir):
    library = cpu_kernels.load_cpu_kernels(cache_dir)
    if library is None:
        pytest.skip("the CPU kernels did not build here")
    yield library
    use_amx_attention(library, True)  # the library's default, for the modules after this one


def _needs_amx(library) -> None:
    if not use_amx_attention(library, True):
        pytest.skip("no AMX-BF16 here: the vector kernels are the only ones")


def _caches(num_blocks, block_size, num_kv_heads, head_dim, gen):
    key = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    return key, value


def _attend_reference(q, key, value, blocks, seq_len, num_queries, group) -> torch.Tensor:
    """q [num_queries, H, D] for the last num_queries positions of seq_len, causal; float64."""
    block_size = key.shape[1]
    slots = torch.arange(seq_len)
    k = key[blocks[slots // block_size], slots % block_size].double().repeat_interleave(group, dim=1)
    v = value[blocks[slots // block_size], slots % block_size].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    positions = seq_len - num_queries + torch.arange(num_queries)
    scores = scores.masked_fill(slots[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


# ---- decode ----

def _decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """Blocks scattered, and rows past each sequence poisoned (NaN keys, infinite values) as a
    recycled block's stale rows could be: they must never reach an output."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 8
    key, value = _caches(num_blocks, block_size, num_kv_heads, head_dim, gen)
    table = (torch.randperm(num_blocks - 1, generator=gen)[:len(seq_lens) * max_blocks] + 1).view(len(seq_lens), -1)
    for req, seq_len in enumerate(seq_lens):
        block, offset = table[req, (seq_len - 1) // block_size], seq_len % block_size
        if offset:
            key[block, offset:] = float("nan")
            value[block, offset:] = float("inf")
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(torch.bfloat16).float()
    return query, key, value, table.long(), torch.tensor(seq_lens, dtype=torch.int64)


def _decode(library, batch, amx: bool) -> torch.Tensor:
    use_amx_attention(library, amx)
    query, key, value, table, seq_lens = batch
    return PagedDecodeKernel(library)(query, key, value, table, seq_lens, int(seq_lens.max()), SCALE)


def _decode_reference(batch) -> torch.Tensor:
    query, key, value, table, seq_lens = batch
    group = query.shape[1] // key.shape[2]
    return torch.stack([_attend_reference(query[r:r + 1], key, value, table[r], int(n), 1, group)[0]
                        for r, n in enumerate(seq_lens.tolist())])


# Sequences of one token, a partial tile, one tile, a tile and one, and several tiles with a tail;
# SmolLM2's GQA 9/3, blocks of 16 and 32, one KV head for 16 query heads, multi-head attention.
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 16), (9, 3, 32), (16, 1, 16), (8, 8, 16)])
def test_decode_on_tiles_gives_the_vector_results_and_stale_rows_never_reach_them(library, num_heads, num_kv_heads,
                                                                                 block_size):
    _needs_amx(library)
    batch = _decode_batch([1, 15, 16, 17, 100, 333], num_heads, num_kv_heads, 64, block_size)
    on_tiles, on_vectors = _decode(library, batch, True), _decode(library, batch, False)
    assert torch.isfinite(on_tiles).all()
    # both round the probabilities to bfloat16 before the value sums: the same error against float64
    assert (on_tiles - _decode_reference(batch)).abs().max() < 4e-3
    assert (on_tiles - on_vectors).abs().max() < 1e-3


def test_decode_shapes_the_tiles_do_not_serve_stay_on_the_vector_passes(library):
    """head_dim 128, blocks of 8 tokens, and steps of fewer than 4 requests: the same results with
    the switch on as off."""
    for num_kv_heads, head_dim, block_size, seq_lens in ((3, 128, 16, [5, 40, 77, 9]), (3, 64, 8, [5, 40, 77, 9]),
                                                        (3, 64, 16, [5, 40, 77])):
        batch = _decode_batch(seq_lens, 9, num_kv_heads, head_dim, block_size, seed=head_dim + block_size)
        on, off = _decode(library, batch, True), _decode(library, batch, False)
        assert torch.equal(on, off)
        assert (on - _decode_reference(batch)).abs().max() < 4e-3


# ---- prefill ----

def _prefill_batch(slices, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """slices: (query tokens, context tokens) each; the caches hold every slice's keys and values."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(q + c) // block_size) for q, c in slices)
    num_blocks = len(slices) * max_blocks + 4
    key, value = _caches(num_blocks, block_size, num_kv_heads, head_dim, gen)
    table = (torch.randperm(num_blocks - 1, generator=gen)[:len(slices) * max_blocks] + 1).view(len(slices), -1)
    num_tokens = sum(q for q, _ in slices)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    starts = torch.tensor([0] + [q for q, _ in slices][:-1]).cumsum(0)
    prefill = PrefillSlices(starts, torch.tensor([q for q, _ in slices]), torch.tensor([q + c for q, c in slices]),
                            table.long().contiguous())
    return query, key, value, prefill


def _prefill(library, batch, amx: bool) -> torch.Tensor:
    use_amx_attention(library, amx)
    query, key, value, slices = batch
    out = torch.zeros(query.shape[0], query.shape[1] * query.shape[2], dtype=torch.bfloat16)
    PagedPrefillKernel(library)(query, key, value, slices, out, SCALE)
    return out.float().view(query.shape)


def _prefill_reference(batch) -> torch.Tensor:
    query, key, value, slices = batch
    group = query.shape[1] // key.shape[2]
    outs = []
    for i in range(slices.num_slices):
        start, n, seq_len = (int(t[i]) for t in (slices.query_starts, slices.query_lens, slices.seq_lens))
        outs.append(_attend_reference(query[start:start + n], key, value, slices.block_table[i], seq_len, n, group))
    return torch.cat(outs)


# A long prompt (several 64-key tiles, rows past 96 per item), short ones (one token, a partial
# tile), chunks after a context (of a partial and several tiles); GQA 9/3, 16/1, MHA; blocks 16, 32.
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 16), (16, 1, 32), (8, 8, 16)])
def test_prefill_on_tiles_gives_the_vector_results(library, num_heads, num_kv_heads, block_size):
    _needs_amx(library)
    if PagedPrefillKernel(library).supports(torch.bfloat16, 64, num_heads, num_kv_heads) is False:
        pytest.skip("no compiled prefill kernel here")
    batch = _prefill_batch([(300, 0), (5, 0), (2, 0), (100, 37), (33, 200)], num_heads, num_kv_heads, 64, block_size)
    on_tiles, on_vectors = _prefill(library, batch, True), _prefill(library, batch, False)
    assert torch.isfinite(on_tiles).all()
    reference = _prefill_reference(batch)
    # outputs rounded to bfloat16: within two of its steps at these magnitudes of the reference
    assert (on_tiles - reference).abs().max() < 1.6e-2
    assert (on_tiles - on_vectors).abs().max() < 1.6e-2
    assert (on_tiles - reference).abs().mean() <= 1.1 * (on_vectors - reference).abs().mean() + 1e-4


def test_prefill_head_dims_the_tiles_do_not_serve_stay_on_the_vector_path(library):
    if not PagedPrefillKernel(library).supports(torch.bfloat16, 128, 9, 3):
        pytest.skip("no compiled prefill kernel here")
    batch = _prefill_batch([(40, 0), (7, 20)], 9, 3, 128, 16, seed=3)
    assert torch.equal(_prefill(library, batch, True), _prefill(library, batch, False))


# ---- the switch ----

def test_the_switch_is_on_only_where_the_library_and_cpu_have_amx(library):
    assert use_amx_attention(library, False) is False and amx_attention_in_use(library) is False
    assert use_amx_attention(library, True) is cpu_has_amx_bf16()
    assert amx_attention_in_use(library) is cpu_has_amx_bf16()


@pytest.mark.parametrize("flag", [True, False])
def test_the_platform_sets_the_switch_from_its_flag_for_bfloat16_only(cache_dir, library, flag):
    """The platform loads the same library (one cache folder), whose switch it sets."""
    config = WorkerConfig(cache_dir=str(cache_dir), cpu_amx_attention=flag)
    use_amx_attention(library, not flag)
    build_platform(config, torch.device("cpu"), torch.bfloat16, AttentionHeads(9, 3, 64))
    assert amx_attention_in_use(library) is (flag and cpu_has_amx_bf16())
    use_amx_attention(library, not flag)
    build_platform(config, torch.device("cpu"), torch.float32, AttentionHeads(9, 3, 64))
    assert amx_attention_in_use(library) is (not flag and cpu_has_amx_bf16())  # float32 leaves it as it was
