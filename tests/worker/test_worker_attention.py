"""The CPU paged attention backends against a dense float64 reference on a mixed batch."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.cpu_kernels import MARCH_FEATURES, _cpu_flags, load_cpu_kernels


MARCHES = ["native", "x86-64-v3"]
_kernels: dict[str, PagedDecodeKernel] = {}


def _kernel(march: str, tmp_path_factory) -> PagedDecodeKernel:
    """The kernel built for this CPU (with AVX512_BF16, its bfloat16 path multiplies with VDPBF16PS)
    or the portable build an image ships (generic vector code only)."""
    if march != "native" and MARCH_FEATURES[march] - _cpu_flags():
        pytest.skip(f"this CPU cannot run {march} code")
    if march not in _kernels:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SPINDLE_CPU_KERNEL_MARCH", march)
            library = load_cpu_kernels(tmp_path_factory.mktemp("kernels"))
        assert library is not None, "the CPU kernels must build here (gcc is on every CI machine)"
        _kernels[march] = PagedDecodeKernel(library)
    return _kernels[march]


@pytest.fixture(params=MARCHES)
def decode_kernel(tmp_path_factory, request):
    return _kernel(request.param, tmp_path_factory)


@pytest.fixture(params=["torch", *MARCHES])
def backend(request, tmp_path_factory):
    if request.param == "torch":
        return TorchAttentionBackend()
    return CpuAttentionBackend(_kernel(request.param, tmp_path_factory))


def _reference(q, k_all, v_all, context_len, scale):
    """q [n, H, D] at positions context_len.., k/v [L, H_kv, D] for the whole sequence."""
    group = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1).double()
    v = v_all.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def test_mixed_batch_matches_dense_reference(backend):
    torch.manual_seed(0)
    bs, heads, kv_heads, dim, num_blocks = 4, 6, 2, 8, 32
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, bs, kv_heads, dim))
    # (context already cached, new tokens this step, block ids)
    reqs = [(9, 1, [3, 17, 5]), (0, 7, [8, 2]), (5, 6, [11, 12, 30]), (0, 1, [4]), (14, 1, [6, 7, 9, 10])]
    full_k = {i: torch.randn(c + n, kv_heads, dim) for i, (c, n, _) in enumerate(reqs)}
    full_v = {i: torch.randn(c + n, kv_heads, dim) for i, (c, n, _) in enumerate(reqs)}
    for i, (c, _, blocks) in enumerate(reqs):  # earlier steps' K/V already in the cache
        for pos in range(c):
            cache[0, blocks[pos // bs], pos % bs] = full_k[i][pos]
            cache[1, blocks[pos // bs], pos % bs] = full_v[i][pos]
    slots, q_lens, seq_lens = [], [], []
    for c, n, blocks in reqs:
        slots += [blocks[p // bs] * bs + p % bs for p in range(c, c + n)]
        q_lens.append(n), seq_lens.append(c + n)
    max_blocks = max(len(b) for *_, b in reqs)
    table = torch.tensor([b + [0] * (max_blocks - len(b)) for *_, b in reqs])
    query_start_loc = torch.tensor([0] + q_lens).cumsum(0)
    common = CommonAttentionMetadata(query_start_loc, torch.tensor(seq_lens), torch.tensor(slots), table, bs,
                                     q_lens, seq_lens)
    q = torch.randn(sum(q_lens), heads, dim)
    k = torch.cat([full_k[i][c:] for i, (c, _, _) in enumerate(reqs)])
    v = torch.cat([full_v[i][c:] for i, (c, _, _) in enumerate(reqs)])
    out = backend.forward(q, k, v, cache, backend.build_metadata(common), scale=dim**-0.5)
    for i, (c, n, _) in enumerate(reqs):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        expected = _reference(q[s:e], full_k[i], full_v[i], c, dim**-0.5)
        torch.testing.assert_close(out[s:e].double(), expected, atol=1e-5, rtol=1e-5)
    # this step's K/V landed in the cache at their slots
    assert torch.equal(cache[0].view(-1, kv_heads, dim)[torch.tensor(slots)], k)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (8, 8, 128, 8), (16, 2, 64, 16), (4, 1, 32, 4),
                                                   (16, 1, 256, 16)])
@pytest.mark.parametrize("num_reqs", [5, 1])
def test_decode_kernel_matches_torch_decode(decode_kernel, cache_dtype, heads, kv_heads, dim, bs, num_reqs):
    """All-decode batches with scattered block tables, padded rows and a one-token context; one
    request alone runs without the thread team."""
    torch.manual_seed(heads * dim + bs)
    num_blocks = 64
    seq_lens = [1, 37, bs, 5 * bs + 3, 2 * bs - 1] if num_reqs > 1 else [20 * bs + 5]
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim).to(cache_dtype)
    max_blocks = -(-max(seq_lens) // bs) + 1  # one padding column, pointing at the null block
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    for i, n in enumerate(seq_lens):
        table[i, : -(-n // bs)] = torch.randperm(num_blocks - 1)[: -(-n // bs)] + 1
    # The new token's K/V is written by forward, so take it from the cache's own slot.
    slots = torch.tensor([table[i, (n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(seq_lens)])
    k = cache[0].view(-1, kv_heads, dim)[slots].clone()
    v = cache[1].view(-1, kv_heads, dim)[slots].clone()
    common = CommonAttentionMetadata(torch.arange(len(seq_lens) + 1), torch.tensor(seq_lens), slots, table, bs,
                                     [1] * len(seq_lens), seq_lens)
    q = torch.randn(len(seq_lens), heads, dim).to(cache_dtype)
    torch_backend, cpu_backend = TorchAttentionBackend(), CpuAttentionBackend(decode_kernel)
    expected = torch_backend.forward(q, k, v, cache.clone(), torch_backend.build_metadata(common), dim**-0.5)
    out = cpu_backend.forward(q, k, v, cache, cpu_backend.build_metadata(common), dim**-0.5)
    assert out.dtype == cache_dtype
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_decode_kernel_refuses_what_it_cannot_run(decode_kernel):
    assert decode_kernel.supports(torch.bfloat16, 64, num_heads=16, num_kv_heads=1)
    assert not decode_kernel.supports(torch.bfloat16, 64, num_heads=17, num_kv_heads=1)  # group over 16
    assert not decode_kernel.supports(torch.bfloat16, 64, num_heads=9, num_kv_heads=2)  # uneven groups
    assert not decode_kernel.supports(torch.bfloat16, 60)  # not a multiple of 8
    assert not decode_kernel.supports(torch.float16, 64)
