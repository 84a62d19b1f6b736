"""The CPU paged attention backends (PyTorch, and PyTorch with decodes on the compiled C kernel,
built for this CPU and as the portable x86-64-v3 library) against the dense float64 reference of
tests/oracles.py: head sizes 8 to 256, block sizes 4 to 32, GQA, mixed prefill/chunk/decode steps
over scattered blocks, float32 and bfloat16 caches."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.torch_backend import GatherDecode, TorchAttentionBackend
from tests.kernels.paged_batch import TOLERANCES, check_batch, make_batch
from tests.oracles import dense_attention
from tests.worker.kernel_builds import MARCHES, library_for

_kernels: dict[str, PagedDecodeKernel] = {}


def _kernel(march: str, kernel_cache) -> PagedDecodeKernel:
    """The kernel built for this CPU (with AVX512_BF16, its bfloat16 path multiplies with VDPBF16PS)
    or the portable build an image ships (generic vector code only)."""
    if march not in _kernels:
        _kernels[march] = PagedDecodeKernel(library_for(march, kernel_cache))
    return _kernels[march]


@pytest.fixture(params=MARCHES)
def decode_kernel(kernel_cache, request):
    return _kernel(request.param, kernel_cache)


@pytest.fixture(params=["torch", *MARCHES])
def backend(request, kernel_cache):
    if request.param == "torch":
        return TorchAttentionBackend()
    return CpuAttentionBackend(_kernel(request.param, kernel_cache))


# Against the float64 reference on the same rounded inputs (TOLERANCES: float32 1e-5, bfloat16
# 1e-2, as atol = rtol): the PyTorch path and the C kernel accumulate in float32, so float32 is off
# by summation order only and bfloat16 by one output rounding plus bfloat16 products (seen: 7e-7
# and 3.1e-3 on these shapes).
# (query heads, KV heads, head size, block size)
MIXED_SHAPES = [(8, 2, 64, 16), (8, 2, 128, 32), (6, 2, 8, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim,bs", MIXED_SHAPES, ids=lambda v: str(v))
def test_mixed_batch_matches_dense_reference(backend, dtype, heads, kv_heads, dim, bs):
    """Prefills, chunked prefills with a query offset across blocks, and decodes in one step, over
    scattered blocks; the reference reads the histories the batch was generated from."""
    batch = make_batch(heads, kv_heads, dim, dtype, block_size=bs, seed=heads * dim + bs)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build_metadata(batch.common),
                          scale=dim**-0.5)
    assert out.dtype == dtype and out.shape == (batch.query.shape[0], heads * dim)
    check_batch(out, batch, dim**-0.5, TOLERANCES[dtype])
    # this step's K/V landed in the cache at their slots
    slots = batch.common.slot_mapping
    assert torch.equal(cache[0].view(-1, kv_heads, dim)[slots], batch.key)
    assert torch.equal(cache[1].view(-1, kv_heads, dim)[slots], batch.value)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (8, 8, 128, 8), (16, 2, 64, 16), (4, 1, 32, 4),
                                                   (16, 1, 256, 16), (8, 2, 128, 32)], ids=lambda v: str(v))
@pytest.mark.parametrize("num_reqs", [5, 1])
def test_decode_kernel_matches_dense_reference(decode_kernel, cache_dtype, heads, kv_heads, dim, bs, num_reqs):
    """All-decode batches with scattered block tables, padded rows and a one-token context; one
    request alone runs without the thread team."""
    seq_lens = [1, 37, bs, 5 * bs + 3, 2 * bs - 1] if num_reqs > 1 else [20 * bs + 5]
    batch = make_batch(heads, kv_heads, dim, cache_dtype, block_size=bs, requests=[(n - 1, 1) for n in seq_lens],
                       seed=heads * dim + bs)
    backend = CpuAttentionBackend(decode_kernel)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                          backend.build_metadata(batch.common), dim**-0.5)
    assert out.dtype == cache_dtype
    check_batch(out, batch, dim**-0.5, TOLERANCES[cache_dtype])


def test_decode_check_tells_a_wrong_reference_apart(decode_kernel):
    """The decode kernel's output fails the same check against a reference that drops each
    query's own key (the causal mask one short), or whose scale is 1% off."""
    batch = make_batch(8, 2, 128, torch.float32, block_size=32, requests=[(0, 1), (40, 1), (100, 1)], seed=4)
    backend = CpuAttentionBackend(decode_kernel)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                          backend.build_metadata(batch.common), 128**-0.5)
    check_batch(out, batch, 128**-0.5, TOLERANCES[torch.float32])

    def one_short(q, k, v, context_len, scale):
        seen = max(context_len, 1)
        return dense_attention(q, k[:seen], v[:seen], seen - 1, scale)

    def scale_off(q, k, v, context_len, scale):
        return dense_attention(q, k, v, context_len, scale * 1.01)

    for wrong in (one_short, scale_off):
        with pytest.raises(AssertionError):
            check_batch(out, batch, 128**-0.5, TOLERANCES[torch.float32], attention=wrong)


def test_decode_kernel_refuses_what_it_cannot_run(decode_kernel):
    assert decode_kernel.supports(torch.bfloat16, 64, num_heads=16, num_kv_heads=1)
    assert not decode_kernel.supports(torch.bfloat16, 64, num_heads=17, num_kv_heads=1)  # group over 16
    assert not decode_kernel.supports(torch.bfloat16, 64, num_heads=9, num_kv_heads=2)  # uneven groups
    assert not decode_kernel.supports(torch.bfloat16, 60)  # not a multiple of 8
    assert not decode_kernel.supports(torch.float16, 64)


def test_the_torch_backend_attends_its_decodes_through_the_decode_strategy_it_was_given():
    """The decode tokens' queries (in decode order) go to the `DecodeAttention`, and its output
    lands at their rows: a strategy that returns zeros fails the reference check on decodes only."""
    batch = make_batch(8, 2, 64, torch.float32, block_size=16, seed=5)
    calls = []

    class Recording(GatherDecode):
        def forward(self, query, key_cache, value_cache, metadata, scale):
            calls.append(query.clone())
            return super().forward(query, key_cache, value_cache, metadata, scale)

    class Zeros(GatherDecode):
        def forward(self, query, key_cache, value_cache, metadata, scale):
            return query.new_zeros(query.shape[0], query.shape[1] * query.shape[2])

    backend = TorchAttentionBackend(Recording())
    metadata = backend.build_metadata(batch.common)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), metadata, 64**-0.5)
    check_batch(out, batch, 64**-0.5, TOLERANCES[torch.float32])
    decode_rows = [i for i, n in enumerate(batch.common.query_lens_cpu) if n == 1]
    assert metadata.decode_token_indices.tolist() == batch.common.query_start_loc[decode_rows].tolist()
    assert len(calls) == 1 and torch.equal(calls[0], batch.query[metadata.decode_token_indices])
    broken = TorchAttentionBackend(Zeros())
    zeros = broken.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                           broken.build_metadata(batch.common), 64**-0.5)
    prefill_rows = torch.ones(zeros.shape[0], dtype=torch.bool)
    prefill_rows[metadata.decode_token_indices] = False
    assert torch.equal(zeros[prefill_rows], out[prefill_rows])
    assert not zeros[metadata.decode_token_indices].any()
    with pytest.raises(AssertionError):
        check_batch(zeros, batch, 64**-0.5, TOLERANCES[torch.float32])
