"""The compiled int8-KV-cache decode kernel (csrc/paged_decode_int8.c), built for this CPU and as
the portable x86-64-v3 library, against a dense float64 attention on the dequantized cache
(tests/oracles.py); the symmetric PyTorch quantizer of W8A8's activations (attention/
int8_kv_cache.py; the cache's own centered rule is tested in test_int8_kv_cache.py), exactly; and
the wrapper's argument checks.

The caches are written by this module's own loop, token by token through random block tables;
every slot no request owns holds random int8 rows, scales and midpoints, so reading a wrong block or past a
sequence's end shows."""
from __future__ import annotations

import random

import pytest
import torch

from services.worker.attention.amx_attention import use_amx_attention
from services.worker.attention.cpu_decode_int8 import PagedDecodeInt8Kernel
from services.worker.attention.int8_kv_cache import (
    int8_block_bytes,
    quantize_int8_rows,
    quantize_kv_rows,
    split_int8_cache,
)
from tests.oracles import dense_attention
from services.worker.cpu_kernels import _cpu_flags
from tests.worker.kernel_builds import MARCHES, library_for

_kernels: dict[str, PagedDecodeInt8Kernel] = {}


def _kernel(march: str, kernel_cache) -> PagedDecodeInt8Kernel:
    """The build for this CPU (with AVX512_BF16 and VBMI, head sizes that are a multiple of 64
    multiply on VDPBF16PS) or the portable one an image ships (float32 passes only)."""
    if march not in _kernels:
        _kernels[march] = PagedDecodeInt8Kernel(library_for(march, kernel_cache))
    return _kernels[march]


@pytest.fixture(params=MARCHES)
def kernel(request, kernel_cache) -> PagedDecodeInt8Kernel:
    return _kernel(request.param, kernel_cache)


def _random_rows(half: int, num_tokens: int, num_kv_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Keys or values of unequal range and centre (so the scales and midpoints differ), one row all
    zeros (scale 0)."""
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    x *= torch.rand(num_tokens, num_kv_heads, 1, generator=gen) * 1.5 + 0.05
    x += torch.randn(num_tokens, num_kv_heads, 1, generator=gen)
    x[num_tokens // 2, 0] = 0
    return x


def _uniform_rows(half: int, num_tokens: int, num_kv_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Zero keys, so every score is 0 and every probability exactly 1, and values whose scales are
    powers of two, exact in bfloat16, about a midpoint of 0: the output is the mean of the values
    up to float32 sums, on the VDPBF16PS passes too."""
    if half == 0:
        return torch.zeros(num_tokens, num_kv_heads, head_dim)
    q = torch.randint(-127, 128, (num_tokens, num_kv_heads, head_dim), generator=gen).float()
    q[..., 0], q[..., 1] = 127, -127  # range +-127 * 2^-k: the quantizer gives back q, scale 2^-k, mid 0
    return q * 2.0 ** torch.randint(-6, 3, (num_tokens, num_kv_heads, 1), generator=gen).float()


def _make_decode(num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_dtype, seed, rows=_random_rows):
    """An int8 cache holding each request's quantized history (`rows` per half), the query, the
    block table and the float64 reference [B, H * D] on the dequantized history."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 5
    free = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(k)] for k in needed]
    block_bytes = int8_block_bytes(block_size, num_kv_heads, head_dim)
    kv_cache = torch.randint(-127, 128, (2, num_blocks, block_bytes), generator=gen, dtype=torch.int8)
    views = [split_int8_cache(kv_cache[half], half, block_size, num_kv_heads, head_dim) for half in range(2)]
    for data, scales, mids in views:  # unowned slots: random rows, finite scales and midpoints
        scales.copy_(torch.rand(scales.shape, generator=gen))
        mids.copy_(torch.randn(mids.shape, generator=gen))
        data[0], scales[0], mids[0] = 0, 0, 0  # the null block
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(query_dtype)
    scale = head_dim**-0.5
    expected = []
    for i, (n, blocks) in enumerate(zip(seq_lens, tables)):
        history = []
        for half in range(2):
            q, s, m = quantize_kv_rows(rows(half, n, num_kv_heads, head_dim, gen))
            data, scales, mids = views[half]
            for pos in range(n):
                data[blocks[pos // block_size], pos % block_size] = q[pos].unflatten(-1, (head_dim // 4, 4))
                scales[blocks[pos // block_size], pos % block_size] = s[pos]
                mids[blocks[pos // block_size], pos % block_size] = m[pos]
            history.append(q.double() * s.double()[..., None] + m.double()[..., None])
        expected.append(dense_attention(query[i:i + 1], history[0], history[1], n - 1, scale))
    width = max(needed) + 2  # padded with the null block, as the runner does
    block_table = torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int64)
    return query, kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int64), scale, torch.cat(expected)


def _tolerance(kernel: PagedDecodeInt8Kernel, head_dim: int) -> float:
    """As the bfloat16 kernel's (tests/kernels/paged_batch.py TOLERANCES, atol = rtol): 1e-2 where
    the query and the weights are rounded to bfloat16 for VDPBF16PS, 1e-5 for the float32 passes
    (off by summation order only)."""
    return 1e-2 if kernel.has_bf16_dot and head_dim % 64 == 0 else 1e-5


# (query heads, KV heads, head size, block size): GQA groups 3, 1, 8, 8, 3, 8; head sizes on the
# VDPBF16PS passes (64, 128) and on the float32 ones everywhere (96, 40).
SHAPES = [(9, 3, 64, 16), (8, 8, 128, 4), (16, 2, 64, 32), (24, 3, 128, 16), (6, 2, 96, 16), (8, 1, 40, 4)]


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim,bs", SHAPES, ids=lambda v: str(v))
def test_decode_matches_dense_reference_on_dequantized_cache(kernel, query_dtype, heads, kv_heads, dim, bs):
    """Contexts of one token, one block, just past and just short of a block boundary, several
    blocks, and past many chunks of 8; scattered, null-padded block tables."""
    seq_lens = [1, bs, bs + 1, 2 * bs - 1, 5 * bs + 3, 37, 300]
    query, kv_cache, block_table, lens, scale, expected = _make_decode(heads, kv_heads, dim, bs, seq_lens,
                                                                       query_dtype, seed=heads * dim + bs)
    out = kernel(query, kv_cache[0], kv_cache[1], block_table, lens, max(seq_lens), scale, bs, kv_heads, dim)
    assert out.dtype == torch.float32 and out.shape == query.shape
    tol = _tolerance(kernel, dim)
    torch.testing.assert_close(out.reshape(expected.shape).double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads,dim,bs", SHAPES, ids=lambda v: str(v))
def test_uniform_attention_is_the_exact_mean_of_the_values(kernel, heads, kv_heads, dim, bs):
    """With every probability 1 and bfloat16-exact weights, nothing rounds but float32 sums: a
    value row read twice, skipped or from the wrong slot would be off by far more than 1e-5."""
    seq_lens = [1, bs, bs + 1, 2 * bs - 1, 5 * bs + 3, 37, 300]
    query, kv_cache, block_table, lens, scale, expected = _make_decode(heads, kv_heads, dim, bs, seq_lens,
                                                                       torch.bfloat16, seed=dim + bs,
                                                                       rows=_uniform_rows)
    out = kernel(query, kv_cache[0], kv_cache[1], block_table, lens, max(seq_lens), scale, bs, kv_heads, dim)
    torch.testing.assert_close(out.reshape(expected.shape).double(), expected, atol=1e-5, rtol=1e-5)


def test_one_request_alone_matches(kernel):
    """One request with one KV head: a single work item, run without the thread team."""
    query, kv_cache, block_table, lens, scale, expected = _make_decode(4, 1, 64, 16, [16 * 20 + 5],
                                                                       torch.float32, seed=7)
    out = kernel(query, kv_cache[0], kv_cache[1], block_table, lens, 16 * 20 + 5, scale, 16, 1, 64)
    tol = _tolerance(kernel, 64)
    torch.testing.assert_close(out.reshape(expected.shape).double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("seq_lens", [[2000, 1, 1, 3, 700, 1, 2], [1, 1, 1, 1, 1, 1, 1500], [1500, 1]],
                         ids=["long-first", "long-last", "two"])
def test_threads_split_skewed_contexts(kernel, seq_lens):
    """The threads' shares follow the contexts' lengths (csrc/decode_items.h): with one long context
    among short ones every item is still attended once, each request's output matching the dense
    reference."""
    query, kv_cache, block_table, lens, scale, expected = _make_decode(9, 3, 64, 16, seq_lens, torch.float32, seed=11)
    out = kernel(query, kv_cache[0], kv_cache[1], block_table, lens, max(seq_lens), scale, 16, 3, 64)
    tol = _tolerance(kernel, 64)
    torch.testing.assert_close(out.reshape(expected.shape).double(), expected, atol=tol, rtol=tol)


# --- the tile passes (csrc/paged_decode_int8_amx.h), where the CPU has AMX-INT8 ---------------------


@pytest.fixture
def tiles(kernel_cache):
    """The native build with attention on the tiles (the library's switch), and a function that
    sets the switch; skips where this CPU has no AMX-INT8."""
    library = library_for("native", kernel_cache)
    if "amx_int8" not in _cpu_flags() or not use_amx_attention(library, True):
        pytest.skip("no AMX-INT8 here: the VNNI or float32 passes are the only ones")
    yield _kernel("native", kernel_cache), lambda enable: use_amx_attention(library, enable)
    use_amx_attention(library, True)


@pytest.mark.parametrize("heads,kv_heads,bs", [(9, 3, 16), (16, 2, 32), (4, 4, 16)], ids=str)
def test_the_tiles_are_within_1e_3_of_the_reference(tiles, heads, kv_heads, bs):
    amx_kernel, use_tiles = tiles
    """15-bit weights against the VNNI pass's bfloat16 ones: the VNNI pass misses this bound
    (3.4e-3 on the first shape), so passing it says the tiles ran; partial tiles of 16, several
    blocks, long contexts."""
    seq_lens = [1, 15, bs + 1, 5 * bs + 3, 37, 300, 1000]
    query, kv_cache, block_table, lens, scale, expected = _make_decode(heads, kv_heads, 64, bs, seq_lens,
                                                                       torch.bfloat16, seed=heads + bs)
    out = amx_kernel(query, kv_cache[0], kv_cache[1], block_table, lens, max(seq_lens), scale, bs, kv_heads, 64)
    torch.testing.assert_close(out.reshape(expected.shape).double(), expected, atol=1e-3, rtol=1e-3)
    use_tiles(False)
    vector = amx_kernel(query, kv_cache[0], kv_cache[1], block_table, lens, max(seq_lens), scale, bs, kv_heads, 64)
    assert not torch.equal(out, vector)


def test_the_tiles_leave_small_steps_to_the_vector_passes(tiles):
    amx_kernel, use_tiles = tiles
    """Under 4 requests the tiles' set-up is not paid back: the same output with the switch off."""
    query, kv_cache, block_table, lens, scale, _ = _make_decode(9, 3, 64, 16, [40, 300, 7], torch.bfloat16, seed=5)
    args = (query, kv_cache[0], kv_cache[1], block_table, lens, 300, scale, 16, 3, 64)
    tiles = amx_kernel(*args)
    use_tiles(False)
    assert torch.equal(tiles, amx_kernel(*args))


def test_a_nan_query_gives_nan_on_the_tiles_and_leaves_the_others(tiles):
    amx_kernel, _ = tiles
    """An item whose weights are not finite runs the VNNI passes: NaN for the query head that has
    it, as the float32 passes give; the other requests' outputs are the tiles' as without it."""
    query, kv_cache, block_table, lens, scale, _ = _make_decode(9, 3, 64, 16, [40, 300, 70, 90, 5], torch.bfloat16,
                                                                seed=6)
    args = (kv_cache[0], kv_cache[1], block_table, lens, 300, scale, 16, 3, 64)
    clean = amx_kernel(query, *args)
    query[1, 4, 7] = float("nan")  # request 1, KV head 1 (query heads 3-5)
    out = amx_kernel(query, *args).view(5, 9, 64)
    nan_heads = torch.isnan(out).any(-1)
    assert torch.isnan(out[1, 4]).all() and nan_heads.sum() == 1
    assert torch.equal(out[[0, 2, 3, 4]], clean.view(5, 9, 64)[[0, 2, 3, 4]])


def test_supports(kernel):
    assert kernel.supports(64, 9, 3) and kernel.supports(128, 16, 1) and kernel.supports(40, 8, 8)
    assert not kernel.supports(60, 8, 2)  # not a multiple of 8
    assert not kernel.supports(512, 8, 2)
    assert not kernel.supports(64, 9, 2)  # uneven groups
    assert not kernel.supports(64, 34, 2)  # 17 query heads per KV head
    assert not kernel.supports(64, 8, 0)


def test_argument_checks(kernel_cache):
    kernel = _kernel("native", kernel_cache)
    query, kv_cache, block_table, lens, scale, _ = _make_decode(9, 3, 64, 16, [5, 20], torch.float32, seed=3)
    args = (block_table, lens, 20, scale)
    kernel(query, kv_cache[0], kv_cache[1], *args, 16, 3, 64)  # the good call
    with pytest.raises(ValueError, match="int8"):
        kernel(query, kv_cache[0].to(torch.int16), kv_cache[1], *args, 16, 3, 64)  # not int8
    with pytest.raises(ValueError, match="int8"):
        kernel(query, kv_cache, kv_cache[1], *args, 16, 3, 64)  # not [num_blocks, block_bytes]
    with pytest.raises(ValueError, match="int8"):
        kernel(query, kv_cache[0], kv_cache[1, :-1], *args, 16, 3, 64)  # halves of different sizes
    wide = torch.zeros(2, kv_cache.shape[1], 2 * kv_cache.shape[2], dtype=torch.int8)
    with pytest.raises(ValueError, match="non-contiguous"):
        kernel(query, wide[0, :, :kv_cache.shape[2]], kv_cache[1], *args, 16, 3, 64)
    with pytest.raises(ValueError, match="int8"):
        kernel(query, kv_cache[0], kv_cache[1], *args, 8, 3, 64)  # block_bytes does not match 8-token blocks
    with pytest.raises(ValueError, match="int8"):
        kernel(query, kv_cache[0], kv_cache[1], *args, 0, 3, 64)
    with pytest.raises(ValueError, match="query"):
        kernel(query[..., :32], kv_cache[0], kv_cache[1], *args, 16, 3, 64)  # head_dim mismatch
    with pytest.raises(ValueError, match="query"):
        kernel(query.to(torch.int32), kv_cache[0], kv_cache[1], *args, 16, 3, 64)
    with pytest.raises(ValueError, match="query heads"):
        kernel(query[:, :8], kv_cache[0], kv_cache[1], *args, 16, 3, 64)  # 8 heads over 3 KV heads
    with pytest.raises(ValueError, match="block table"):
        kernel(query, kv_cache[0], kv_cache[1], block_table.int(), lens, 20, scale, 16, 3, 64)
    with pytest.raises(ValueError, match="block table"):
        kernel(query, kv_cache[0], kv_cache[1], block_table[:1], lens, 20, scale, 16, 3, 64)
    with pytest.raises(ValueError, match="seq_lens"):
        kernel(query, kv_cache[0], kv_cache[1], block_table, lens.int(), 20, scale, 16, 3, 64)
    with pytest.raises(ValueError, match="seq_lens"):
        kernel(query, kv_cache[0], kv_cache[1], block_table, lens[:1], 20, scale, 16, 3, 64)


# --- the symmetric PyTorch quantizer (W8A8's activations) ------------------------------------------


def test_quantizer_rounds_half_to_even_in_float32():
    x = torch.tensor([[[2.0, 1.0, -1.0, 0.0], [127.0, 2.5, -3.5, -127.0]]])  # [T=1, H=2, D=4]
    q, scale = quantize_int8_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == x.shape and scale.shape == (1, 2)
    # 127 / 2 = 63.5 exactly: 1 * 63.5 rounds to 64, not 63; 2.5 and -3.5 to 2 and -4
    assert q.tolist() == [[[127, 64, -64, 0], [127, 2, -4, -127]]]
    assert torch.equal(scale, torch.tensor([[2.0, 127.0]]) / 127.0)  # amax / 127 in float32


def test_quantizer_matches_its_definition_and_round_trips():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        q, scale = quantize_int8_rows(xd)
        x32 = xd.float()
        amax = x32.abs().amax(-1)
        expected = torch.round(x32 * (127.0 / amax)[..., None]).clamp(-127, 127)
        assert torch.equal(q.float(), expected)
        assert torch.equal(scale, amax / 127.0)
        assert int(q.min()) >= -127 and int(q.abs().amax(-1).min()) == 127  # each row's largest hits 127
        err = (q.float() * scale[..., None] - x32).abs()
        assert bool((err <= scale[..., None] * (0.5 + 1e-5)).all())  # within half a step


def test_quantizer_zero_rows_get_scale_zero():
    x = torch.zeros(2, 2, 8)
    x[1, 1, 3] = -1.0
    q, scale = quantize_int8_rows(x)
    assert torch.equal(scale, torch.tensor([[0.0, 0.0], [0.0, 1.0]]) / 127.0)
    assert int(q.abs().sum()) == 127 and int(q[1, 1, 3]) == -127  # -amax is -127, never -128


def test_quantizer_gives_back_rows_it_can_represent():
    """int8 rows whose largest magnitude is 127, times a power of two, come back exactly (the
    uniform-attention test relies on it)."""
    gen = torch.Generator().manual_seed(1)
    q0 = torch.randint(-127, 128, (20, 2, 64), generator=gen, dtype=torch.int8)
    q0[..., 5] = torch.where(torch.rand(20, 2, generator=gen) < 0.5, 127, -127).to(torch.int8)
    scale0 = 2.0 ** torch.randint(-8, 4, (20, 2), generator=gen).float()
    q, scale = quantize_int8_rows(q0.float() * scale0[..., None])
    assert torch.equal(q, q0) and torch.equal(scale, scale0)
