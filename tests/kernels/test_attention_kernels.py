"""reshape_and_cache and paged_attention executed on the CPU through the shim, against the dense
float64 reference (tests/oracles.py) over the histories the batch was generated from: ragged
contexts (0, 1, prefills and chunked prefills across blocks, several 128-key tiles), scattered
block tables, GQA 1/3/4/8/12, head sizes 64 and 128, block sizes 16 and 32, float32/bfloat16/
float16 caches, split-K on and off; and proofs that a slightly wrong reference is told apart."""
from __future__ import annotations

import pytest
import torch

from services.worker.kernels.attention_ops import paged_attention, plan_partitions
from services.worker.kernels.cache_ops import reshape_and_cache
from tests.kernels.paged_batch import TOLERANCES, check_batch, make_batch
from tests.oracles import dense_attention

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (query heads, KV heads): GQA ratios 1, 3 (a part-filled tile of 4), 4, 8 (MQA) and 12 (a full
# tile of 8, then a part-filled one)
HEADS = ((2, 2), (6, 2), (8, 2), (8, 1), (12, 1))


def run_attention(shim, batch, num_partitions: int) -> torch.Tensor:
    cache = batch.kv_cache.clone()
    shim(reshape_and_cache(cache, batch.key, batch.value, batch.common.slot_mapping))
    out = torch.full((batch.query.shape[0], batch.query.shape[1] * batch.query.shape[2]), float("nan"),
                     dtype=batch.query.dtype)
    c = batch.common
    for launch in paged_attention(out, batch.query, cache, c.block_table, c.query_start_loc, c.seq_lens,
                                  batch.query.shape[2] ** -0.5, batch.max_seq_len, num_partitions):
        shim(launch)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_strided_rows_at_their_slots(shim, dtype):
    batch = make_batch(4, 2, 64, dtype, fused_qkv=True)
    assert not batch.key.is_contiguous()
    cache = batch.kv_cache.clone()
    slots = batch.common.slot_mapping.clone()
    slots[1] = -1  # padding: skipped
    shim(reshape_and_cache(cache, batch.key, batch.value, slots))
    expected = batch.kv_cache.clone()
    keep = slots >= 0
    expected[0].view(-1, 2, 64)[slots[keep]] = batch.key[keep]
    expected[1].view(-1, 2, 64)[slots[keep]] = batch.value[keep]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_partitions", (1, 3), ids=("single", "split3"))
@pytest.mark.parametrize("block_size", (16, 32), ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_matches_dense_reference(shim, dtype, head_dim, heads, block_size, num_partitions):
    batch = make_batch(*heads, head_dim, dtype, block_size=block_size, seed=head_dim + heads[0] + block_size)
    out = run_attention(shim, batch, num_partitions)
    check_batch(out, batch, head_dim**-0.5, TOLERANCES[dtype])
    if num_partitions > 1:
        assert shim.launches[-1].startswith("spindle::paged_attention_combine")


def test_other_block_sizes_and_fused_views(shim):
    batch = make_batch(6, 2, 64, torch.float32, block_size=8, fused_qkv=True, seed=3,
                       requests=((0, 3), (15, 1), (8, 8), (129, 1)))
    check_batch(run_attention(shim, batch, 2), batch, 0.125, TOLERANCES[torch.float32])


def _mask_one_short(q, k, v, context_len, scale):
    """Queries past position 0 do not see their own key: the causal mask shifted by one."""
    rows = []
    for i, pos in enumerate(range(context_len, context_len + q.shape[0])):
        seen = max(pos, 1)
        rows.append(dense_attention(q[i:i + 1], k[:seen], v[:seen], seen - 1, scale))
    return torch.cat(rows)


def _scale_off(q, k, v, context_len, scale):
    return dense_attention(q, k, v, context_len, scale * 1.01)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_the_check_tells_a_slightly_wrong_reference_apart(shim, dtype):
    """The same kernel output and the same check: the true reference passes, a reference with the
    causal mask one position short or the scale 1% off fails."""
    batch = make_batch(8, 2, 128, dtype, block_size=32, seed=11)
    out = run_attention(shim, batch, 1)
    check_batch(out, batch, 128**-0.5, TOLERANCES[dtype])
    with pytest.raises(AssertionError):
        check_batch(out, batch, 128**-0.5, TOLERANCES[dtype], attention=_mask_one_short)
    if dtype == torch.float32:  # within bfloat16's output rounding a 1% scale error can hide
        with pytest.raises(AssertionError):
            check_batch(out, batch, 128**-0.5, TOLERANCES[dtype], attention=_scale_off)


def test_split_plan():
    assert plan_partitions(max_seq_len=300, num_ctas=64, num_sms=132) == 1  # short: one partition
    assert plan_partitions(max_seq_len=2048, num_ctas=64 * 8, num_sms=132) == 4  # few CTAs: split
    assert plan_partitions(max_seq_len=2048, num_ctas=4096, num_sms=132) == 1  # GPU already full


@pytest.mark.parametrize("bad", ("head_dim", "dtype", "table_dtype", "unaligned"))
def test_wrappers_reject_what_the_kernel_cannot_read(bad):
    batch = make_batch(4, 2, 64, torch.float32, requests=((0, 2),))
    c = batch.common
    query, cache, table = batch.query, batch.kv_cache, c.block_table
    if bad == "head_dim":
        query, cache = query[..., :32], cache[..., :32].contiguous()
    elif bad == "dtype":
        query = query.half()
    elif bad == "table_dtype":
        table = table.int()
    elif bad == "unaligned":
        cache = torch.empty(cache.numel() + 1)[1:].view(cache.shape)
    out = torch.empty(query.shape[0], query.shape[1] * query.shape[2])
    with pytest.raises(ValueError):
        paged_attention(out, query, cache, table, c.query_start_loc, c.seq_lens, 0.125, batch.max_seq_len)
