"""Decode attention on the AMX tile unit (csrc/paged_decode_amx.c) against the AVX-512 / vector
passes and a float64 reference where the CPU has AMX-BF16; on every machine the switch, the
shapes that stay on the vector passes, and the platform's flag."""
from __future__ import annotations

import pytest
import torch

from services.worker import cpu_kernels
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.config import WorkerConfig, cpu_has_amx_bf16
from services.worker.platforms import AttentionHeads, build_platform

SCALE = 0.125


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def kernel(cache_dir):
    library = cpu_kernels.load_cpu_kernels(cache_dir)
    if library is None:
        pytest.skip("the CPU kernels did not build here")
    decode = PagedDecodeKernel(library)
    yield decode
    decode.use_amx(True)  # the library's default, for the modules after this one


def _batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """bfloat16 caches with blocks scattered, and rows past each sequence poisoned (NaN keys,
    infinite values) as a recycled block's stale rows could be: they must never reach an output."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = num_reqs * max_blocks + 8
    key = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    block_table = (torch.randperm(num_blocks - 1, generator=gen)[:num_reqs * max_blocks] + 1).view(num_reqs, -1)
    for req, seq_len in enumerate(seq_lens):
        block, offset = block_table[req, (seq_len - 1) // block_size], seq_len % block_size
        if offset:
            key[block, offset:] = float("nan")
            value[block, offset:] = float("inf")
    query = torch.randn(num_reqs, num_heads, head_dim, generator=gen).to(torch.bfloat16).float()
    return query, key, value, block_table.long(), torch.tensor(seq_lens, dtype=torch.int64)


def _reference(query, key, value, block_table, seq_lens) -> torch.Tensor:
    _, block_size, num_kv_heads, _ = key.shape
    group = query.shape[1] // num_kv_heads
    outs = []
    for req, seq_len in enumerate(seq_lens.tolist()):
        slots = torch.arange(seq_len)
        blocks, offsets = block_table[req, slots // block_size], slots % block_size
        k = key[blocks, offsets].double().repeat_interleave(group, dim=1)
        v = value[blocks, offsets].double().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,thd->ht", query[req].double(), k) * SCALE).softmax(-1)
        outs.append(torch.einsum("ht,thd->hd", probs, v))
    return torch.stack(outs).float()


def _decode(kernel, batch, amx: bool) -> torch.Tensor:
    kernel.use_amx(amx)
    query, key, value, block_table, seq_lens = batch
    return kernel(query, key, value, block_table, seq_lens, int(seq_lens.max()), SCALE)


def _needs_amx(kernel) -> None:
    if not kernel.use_amx(True):
        pytest.skip("no AMX-BF16 here: the vector passes are the only ones")


# Sequences of one token, a partial tile, one tile, a tile and one, and several tiles with a tail;
# SmolLM2's GQA 9/3, blocks of 16 and 32, one KV head for 16 query heads, multi-head attention.
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(9, 3, 16), (9, 3, 32), (16, 1, 16), (8, 8, 16)])
def test_the_tiles_give_the_vector_passes_results_and_stale_rows_never_reach_them(kernel, num_heads, num_kv_heads,
                                                                                 block_size):
    _needs_amx(kernel)
    batch = _batch([1, 15, 16, 17, 100, 333], num_heads, num_kv_heads, 64, block_size)
    on_tiles, on_vectors = _decode(kernel, batch, True), _decode(kernel, batch, False)
    assert torch.isfinite(on_tiles).all()
    reference = _reference(*batch)
    # both round the probabilities to bfloat16 before the value sums: the same error against float64
    assert (on_tiles - reference).abs().max() < 4e-3
    assert (on_tiles - on_vectors).abs().max() < 1e-3


def test_shapes_the_tiles_do_not_serve_stay_on_the_vector_passes(kernel):
    """head_dim 128 and blocks of 8 tokens: the same results with the switch on as off."""
    for num_kv_heads, head_dim, block_size in ((3, 128, 16), (3, 64, 8)):
        batch = _batch([5, 40, 77], 9, num_kv_heads, head_dim, block_size, seed=head_dim + block_size)
        on, off = _decode(kernel, batch, True), _decode(kernel, batch, False)
        assert torch.equal(on, off)
        assert (on - _reference(*batch)).abs().max() < 4e-3


def test_the_switch_is_on_only_where_the_library_and_cpu_have_amx(kernel):
    assert kernel.use_amx(False) is False and kernel.amx_in_use is False
    assert kernel.use_amx(True) is cpu_has_amx_bf16()
    assert kernel.amx_in_use is cpu_has_amx_bf16()


@pytest.mark.parametrize("flag", [True, False])
def test_the_platform_sets_the_switch_from_its_flag_for_bfloat16_only(cache_dir, kernel, flag):
    """The platform loads the same library as `kernel` (one cache folder), whose switch it sets."""
    config = WorkerConfig(cache_dir=str(cache_dir), cpu_amx_attention=flag)
    kernel.use_amx(not flag)
    build_platform(config, torch.device("cpu"), torch.bfloat16, AttentionHeads(9, 3, 64))
    assert kernel.amx_in_use is (flag and cpu_has_amx_bf16())
    kernel.use_amx(not flag)
    build_platform(config, torch.device("cpu"), torch.float32, AttentionHeads(9, 3, 64))
    assert kernel.amx_in_use is (not flag and cpu_has_amx_bf16())  # float32 leaves it as it was
