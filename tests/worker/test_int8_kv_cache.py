"""The int8 KV cache (`--kv-cache-dtype int8`): the compiled writer against the PyTorch quantizer
(bit for bit, into the documented layout), the backend's mixed steps against the float64 reference
over the dequantized history, the platform's choice and refusals, and sizing."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.cpu_decode_int8 import PagedDecodeInt8Kernel
from services.worker.attention.cpu_int8_backend import Int8CacheCpuBackend
from services.worker.attention.cpu_prefill import PagedPrefillKernel
from services.worker.attention.int8_kv_cache import (
    Int8KVDequantizer,
    Int8KVWriter,
    dequantize_blocks,
    int8_block_bytes,
    quantize_kv_rows,
    split_int8_cache,
)
from services.worker.config import WorkerConfig, config_from_args
from services.worker.kv_cache import KVCacheLayout, allocate_kv_caches
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms.cuda import CudaPlatform
from tests.kernels.paged_batch import DEFAULT_REQUESTS, TOLERANCES, make_batch
from tests.oracles import DenseRequest, check_attention
from tests.worker.kernel_builds import MARCHES, library_for

@pytest.fixture(scope="module", params=MARCHES)
def library(request, kernel_cache):
    return library_for(request.param, kernel_cache)


def _empty_cache(num_blocks, block_size, num_kv_heads, head_dim) -> torch.Tensor:
    return torch.zeros(Int8CacheCpuBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim),
                       dtype=torch.int8)


def test_quantizer_centers_each_row_rounds_half_to_even_and_gives_constant_rows_scale_zero():
    # min 10, max 264: midpoint 137, scale 1; -0.5 and 2.5 below/above it round to even.
    x = torch.tensor([[[264.0, 10.0, 136.5, 139.5, 137.4, 200.0, 137.0, 74.0]], [[5.0] * 8]])
    q, scale, mid = quantize_kv_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and mid.dtype == torch.float32
    assert q[0, 0].tolist() == [127, -127, 0, 2, 0, 63, 0, -63]
    assert scale[0, 0].item() == 1.0 and mid[0, 0].item() == 137.0
    assert q[1, 0].tolist() == [0] * 8 and scale[1, 0].item() == 0.0 and mid[1, 0].item() == 5.0  # exact
    # A one-sided row (all positive, as keys' rows often are) takes the whole range on both sides,
    # where a symmetric rule would leave the negative half unused.
    rows = (torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]).abs() + 1.0
    q, scale, mid = quantize_kv_rows(rows)
    assert int(q.amax(dim=-1).min()) == 127 and int(q.amin(dim=-1).max()) == -127
    error = (mid[..., None] + q.float() * scale[..., None] - rows).abs()
    assert bool((error <= scale[..., None] / 2 * (1 + 1e-4) + 1e-6 * rows.abs()).all())  # half a step
    symmetric_step = rows.abs().amax(dim=-1) / 127
    assert bool((scale < symmetric_step).all())
    # NaN is 0 and an infinity the largest float, as nan_to_num makes them; no overflow in between.
    q, scale, mid = quantize_kv_rows(torch.tensor([[float("nan"), 2.0, float("inf"), -float("inf")]]))
    assert q.tolist() == [[0, 0, 127, -127]] and mid.item() == 0.0 and torch.isfinite(scale).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_writer_puts_the_quantizers_bits_at_each_slot_of_the_layout(library, dtype, block_size):
    num_tokens, num_heads, num_kv_heads, head_dim, num_blocks = 37, 6, 3, 64, 12
    gen = torch.Generator().manual_seed(block_size)
    # k and v as strided views of one fused projection, as the model hands them over.
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots[5] = -1  # skipped
    cache = _empty_cache(num_blocks, block_size, num_kv_heads, head_dim)
    Int8KVWriter(library)(k, v, cache, slots, block_size)
    for half, x in ((0, k), (1, v)):
        data, scales, mids = split_int8_cache(cache[half], half, block_size, num_kv_heads, head_dim)
        q, scale, mid = quantize_kv_rows(x)
        written = [t for t in range(num_tokens) if t != 5]
        blocks, offsets = slots[written] // block_size, slots[written] % block_size
        assert torch.equal(data[blocks, offsets].flatten(-2), q[written])
        assert torch.equal(scales[blocks, offsets], scale[written])
        assert torch.equal(mids[blocks, offsets], mid[written])
        untouched = torch.ones(num_blocks, block_size, dtype=torch.bool)
        untouched[blocks, offsets] = False
        assert int(data[untouched].abs().sum()) == 0 and float(scales[untouched].abs().sum()) == 0.0
        assert float(mids[untouched].abs().sum()) == 0.0
        dense = dequantize_blocks(cache[half], half, blocks.unique(), block_size, num_kv_heads, head_dim, torch.float32)
        assert dense.shape == (blocks.unique().numel(), block_size, num_kv_heads, head_dim)
        unique = blocks.unique()
        assert torch.equal(dense, data[unique].float().flatten(-2) * scales[unique][..., None] + mids[unique][..., None])
        # The compiled dequantizer gives the reference's values bit for bit, in both dtypes, for
        # blocks in any order and repeated.
        some = torch.cat([blocks.unique().flip(0), blocks[:3]])
        for out_dtype in (torch.float32, torch.bfloat16):
            compiled = Int8KVDequantizer(library)(cache[half], half, some, block_size, num_kv_heads, head_dim, out_dtype)
            reference = dequantize_blocks(cache[half], half, some, block_size, num_kv_heads, head_dim, out_dtype)
            assert compiled.dtype == out_dtype and torch.equal(compiled, reference)
    # The documented byte order, spelled out for one element of each half: token 0's row for KV
    # head 2, dimension 37 (four 9, second of the four), its scale and its midpoint.
    block, offset, h, d = int(slots[0]) // block_size, int(slots[0]) % block_size, 2, 37
    (q_k, s_k, m_k), (q_v, s_v, m_v) = quantize_kv_rows(k), quantize_kv_rows(v)
    key_byte = h * head_dim * block_size + (d // 4) * 4 * block_size + 4 * offset + d % 4
    assert int(cache[0, block, key_byte]) == int(q_k[0, h, d])
    assert int(cache[1, block, (offset * num_kv_heads + h) * head_dim + d]) == int(q_v[0, h, d])
    scale_byte = block_size * num_kv_heads * head_dim + 4 * (h * block_size + offset)
    mid_byte = scale_byte + 4 * block_size * num_kv_heads
    for half, s, m in ((0, s_k, m_k), (1, s_v, m_v)):
        assert cache[half, block, scale_byte:scale_byte + 4].view(torch.float32).item() == s[0, h].item()
        assert cache[half, block, mid_byte:mid_byte + 4].view(torch.float32).item() == m[0, h].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 20, 48, 64, 128])
def test_writer_matches_the_reference_bit_for_bit_on_awkward_rows(library, dtype, head_dim):
    """Rows of 16-multiples run 16 lanes where the CPU has AVX-512, others the scalar loop; both
    must give the reference's bits, signed zeros of the scales and midpoints included."""
    num_kv_heads, block_size, num_blocks = 2, 16, 4
    gen = torch.Generator().manual_seed(head_dim)
    rows = torch.randn(12, num_kv_heads, head_dim, generator=gen) * 5
    rows[0, 0] = 0.0  # all +0
    rows[0, 1] = -0.0  # all -0
    rows[1, 0, ::2], rows[1, 0, 1::2] = -0.0, 0.0  # zeros of both signs
    rows[1, 1] = rows[1, 1].abs()
    rows[1, 1, 3] = 0.0  # the minimum an exact zero
    rows[2, 0] = -rows[2, 0].abs()
    rows[2, 0, 5] = -0.0  # the maximum a negative zero
    rows[2, 1] = 7.25  # constant
    rows[3, 0, 1], rows[3, 0, 2], rows[3, 0, 3] = float("nan"), float("inf"), -float("inf")
    rows[3, 1, :] = float("nan")
    rows[4, 0, -1] = 3e38  # near the float32 limit
    rows[4, 1, 0], rows[4, 1, 1] = -3e38, 3e38
    half = head_dim // 2
    rows[5, 0, ::2], rows[5, 0, 1::2] = 0.0, -0.0
    rows[5, 1, :half], rows[5, 1, half:] = 0.0, -0.0
    rows[6, 0, :half], rows[6, 0, half:] = -0.0, 0.0
    rows[6, 1, :-1], rows[6, 1, -1] = 0.0, -0.0
    rows[7, 0, :1], rows[7, 0, 1:] = -0.0, 0.0
    x = rows.to(dtype)
    slots = torch.arange(x.shape[0]) + block_size
    cache = _empty_cache(num_blocks, block_size, num_kv_heads, head_dim)
    Int8KVWriter(library)(x, x, cache, slots, block_size)
    q, scale, mid = quantize_kv_rows(x)
    for half in (0, 1):
        data, scales, mids = split_int8_cache(cache[half], half, block_size, num_kv_heads, head_dim)
        blocks, offsets = slots // block_size, slots % block_size
        assert torch.equal(data[blocks, offsets].flatten(-2), q)
        assert torch.equal(scales[blocks, offsets].contiguous().view(torch.int32), scale.view(torch.int32))
        assert torch.equal(mids[blocks, offsets].contiguous().view(torch.int32), mid.view(torch.int32))


def test_writer_refuses_a_slot_past_the_cache_before_writing_anything(library):
    cache = _empty_cache(4, 16, 3, 64)
    k = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="past the cache"):
        Int8KVWriter(library)(k, k, cache, torch.tensor([3, 64]), 16)
    assert int(cache.abs().sum()) == 0
    with pytest.raises(ValueError, match="int8 cache"):
        Int8KVWriter(library)(k, k, _empty_cache(4, 8, 3, 64), torch.tensor([3, 4]), 16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        Int8KVWriter(library)(k.half(), k.half(), cache, torch.tensor([3, 4]), 16)


def test_dequantizer_refuses_what_it_cannot_read(library):
    cache = _empty_cache(4, 16, 3, 64)
    dequantize = Int8KVDequantizer(library)
    with pytest.raises(ValueError, match="lie in the cache"):
        dequantize(cache[0], 0, torch.tensor([1, 4]), 16, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="cache half"):
        dequantize(cache[0], 0, torch.tensor([1]), 8, 3, 64, torch.float32)  # wrong block size
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        dequantize(cache[0], 0, torch.tensor([1]), 16, 3, 64, torch.float16)
    assert dequantize(cache[1], 1, torch.tensor([], dtype=torch.int64), 16, 3, 64, torch.float32).shape == (0, 16, 3, 64)


def _int8_batch(library, dtype, block_size, seed, num_heads=9, num_kv_heads=3, head_dim=64,
                requests=DEFAULT_REQUESTS):
    """make_batch's step over an int8 cache holding its quantized history, with the reference
    histories replaced by what the cache holds: the dequantized keys and values."""
    batch = make_batch(num_heads, num_kv_heads, head_dim, dtype, block_size=block_size, requests=requests, seed=seed)
    num_blocks = batch.kv_cache.shape[1]
    cache = _empty_cache(num_blocks, block_size, num_kv_heads, head_dim)
    writer = Int8KVWriter(library)
    dense = []
    for r, blocks in zip(batch.dense, batch.tables):
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(r.context_len)],
                             dtype=torch.int64)
        if r.context_len:
            writer(r.keys[: r.context_len].contiguous(), r.values[: r.context_len].contiguous(), cache, slots, block_size)
        (qk, sk, mk), (qv, sv, mv) = quantize_kv_rows(r.keys), quantize_kv_rows(r.values)
        dense.append(DenseRequest(qk.float() * sk[..., None] + mk[..., None], qv.float() * sv[..., None] + mv[..., None],
                                  r.query_len))
    return batch, cache, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_mixed_step_attends_over_the_dequantized_history(library, dtype, block_size):
    """Prefills, chunks and decodes in one step: written, then attended (decode kernel for the
    decodes, the prefill kernel or SDPA over the dequantized blocks for the rest)."""
    batch, cache, dense = _int8_batch(library, dtype, block_size, seed=block_size)
    prefill_kernel = PagedPrefillKernel(library)
    for kernel in (prefill_kernel if prefill_kernel.is_available else None, None):
        backend = Int8CacheCpuBackend(PagedDecodeInt8Kernel(library), Int8KVWriter(library),
                                      Int8KVDequantizer(library), 3, 64, kernel)
        out = backend.forward(batch.query, batch.key, batch.value, cache.clone(),
                              backend.build_metadata(batch.common), 0.125)
        assert out.dtype == dtype and out.shape == (batch.query.shape[0], 9 * 64)
        # The decode kernel's VDPBF16PS pass rounds a float32 query and the weights to bfloat16 too,
        # an error of the int8 rows' own size (their step is 1/254 of each row's range).
        tol = TOLERANCES[torch.bfloat16] if backend.decode.kernel.has_bf16_dot else TOLERANCES[dtype]
        check_attention(out, batch.query, dense, 0.125, tol)


def test_layout_sizes_and_allocation_follow_the_int8_rows():
    layout = KVCacheLayout(30, 3, 64, 16, torch.bfloat16, "int8")
    assert layout.cache_dtype == torch.int8
    assert layout.bytes_per_block == 2 * 30 * 16 * 3 * (64 + 8)  # against bf16's 2 * 30 * 16 * 3 * 128
    assert KVCacheLayout(30, 3, 64, 16, torch.bfloat16).bytes_per_block == 2 * 30 * 16 * 3 * 128
    backend = Int8CacheCpuBackend.__new__(Int8CacheCpuBackend)
    caches = allocate_kv_caches(KVCacheLayout(2, 3, 64, 16, torch.float32, "int8"), 5, backend, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 5, int8_block_bytes(16, 3, 64))] * 2
    assert all(c.dtype == torch.int8 and int(c.abs().sum()) == 0 for c in caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_platform_builds_the_int8_backend_and_refuses_what_it_cannot_serve(dtype, kernel_cache,
                                                                                monkeypatch):
    heads = AttentionHeads(num_heads=9, num_kv_heads=3, head_dim=64)
    config = WorkerConfig(kv_cache_dtype="int8", cache_dir=str(kernel_cache))
    platform = build_platform(config, torch.device("cpu"), dtype, heads)
    assert isinstance(platform.attention_backend, Int8CacheCpuBackend)
    with pytest.raises(ValueError, match="does not serve"):
        build_platform(config, torch.device("cpu"), dtype, AttentionHeads(num_heads=9, num_kv_heads=3, head_dim=300))
    monkeypatch.setattr("services.worker.platforms.cpu.load_cpu_kernels", lambda cache_dir: None)
    with pytest.raises(ValueError, match="compiled CPU kernels"):
        build_platform(config, torch.device("cpu"), dtype, heads)


def test_the_flag_its_variable_and_what_the_config_and_the_gpu_refuse(monkeypatch):
    assert WorkerConfig().kv_cache_dtype == "auto" and config_from_args([]).kv_cache_dtype == "auto"
    assert config_from_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    monkeypatch.setenv("SPINDLE_KV_CACHE_DTYPE", "int8")
    assert config_from_args([]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        config_from_args(["--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp8'"):
        WorkerConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="--attention-backend torch"):
        WorkerConfig(kv_cache_dtype="int8", attention_backend="torch")
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        WorkerConfig(kv_cache_dtype="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="CPU only"):
        CudaPlatform.from_config(WorkerConfig(kv_cache_dtype="int8"), torch.device("cuda"), torch.bfloat16,
                                 AttentionHeads(4, 2, 16))
