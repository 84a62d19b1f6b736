"""The fused CPU layers (csrc/fused_ops.c) against the PyTorch reference ops (`TorchLayerOps`), and
the CPU platform's `CpuLayerOps` routing: the kernel where it applies, PyTorch elsewhere."""
from __future__ import annotations

import pytest
import torch

from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.layers.activation import SiluAndMul
from services.worker.layers.attention import Attention
from services.worker.layers.fused_ops import CpuLayerOps, FusedOps
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.layers.layernorm import RMSNorm
from services.worker.layers.rotary_embedding import get_rope, rotate


@pytest.fixture(scope="module")
def ops(kernel_cache) -> FusedOps:
    library = load_cpu_kernels(kernel_cache)
    assert library is not None, "the CPU kernels must build here (gcc is on every CI machine)"
    return FusedOps(library)


@pytest.fixture
def cpu_ops(ops) -> CpuLayerOps:
    return CpuLayerOps(ops)


def _norms(hidden: int, dtype: torch.dtype, cpu_ops: CpuLayerOps) -> tuple[RMSNorm, RMSNorm]:
    """The same RMSNorm on the PyTorch reference and on the CPU ops."""
    reference, fused = RMSNorm(hidden, 1e-5, TorchLayerOps()), RMSNorm(hidden, 1e-5, cpu_ops)
    with torch.no_grad():
        reference.weight.copy_(torch.rand(hidden) + 0.5)
        fused.weight.copy_(reference.weight)
    return reference.to(dtype), fused.to(dtype)


def _tolerance(dtype):
    # float32: summation order only; bfloat16: one rounding step of the result.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (7, 64), (300, 200), (2048, 576)])
def test_rms_norm_with_and_without_residual_matches_pytorch(cpu_ops, dtype, num_tokens, hidden):
    torch.manual_seed(num_tokens + hidden)
    reference, norm = _norms(hidden, dtype, cpu_ops)
    x = (torch.randn(num_tokens, hidden) * 3).to(dtype)
    residual = torch.randn(num_tokens, hidden).to(dtype)
    expected_alone = reference(x)
    expected, expected_residual = reference(x, residual)
    alone = norm(x)
    assert alone.data_ptr() != x.data_ptr()  # without a residual the input is left alone
    x_in, residual_in = x.clone(), residual.clone()
    out, out_residual = norm(x_in, residual_in)
    # In place: the kernel's two results live in the tensors it was given.
    assert out.data_ptr() == x_in.data_ptr() and out_residual.data_ptr() == residual_in.data_ptr()
    assert torch.equal(out_residual, expected_residual)  # one addition, rounded once: exact
    torch.testing.assert_close(alone, expected_alone, **_tolerance(dtype))
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,width", [(1, 3072), (5, 2 * 13), (3, 2 * 40), (64, 3072), (2048, 3072)])
def test_silu_and_mul_matches_pytorch(ops, dtype, num_tokens, width, monkeypatch):
    torch.manual_seed(num_tokens + width)
    x = (torch.randn(num_tokens, width) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    expected = SiluAndMul(TorchLayerOps())(x)
    out = ops.silu_and_mul(x)
    assert out.shape == (num_tokens, width // 2) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    if dtype == torch.bfloat16:  # 16-lane rows, 8-lane tails and scalar ends all round as PyTorch does
        assert torch.equal(out[1:], expected[1:]) and torch.equal(out[0, 4:], expected[0, 4:])
    # The CPU ops take the kernel for float32, and for bfloat16 where it rounds with VCVTNEPS2BF16
    # (elsewhere PyTorch's bfloat16 kernel is as fast).
    act = SiluAndMul(CpuLayerOps(ops))
    calls, kernel = [], ops.silu_and_mul
    monkeypatch.setattr(ops, "silu_and_mul", lambda t: calls.append(t) or kernel(t))
    torch.testing.assert_close(act(x), expected, **_tolerance(dtype))
    assert len(calls) == (dtype == torch.float32 or ops.has_native_bf16_silu)


def test_bfloat16_silu_is_pytorchs_for_every_gate(ops):
    """Every one of the 65,536 bfloat16 gates (where AVX-512 builds look the SiLU up in a table):
    16-lane rows and the scalar ends of a row whose width is not a multiple of 16 give PyTorch's
    bits for 1e-30 <= |gate| <= 80; elsewhere they are within 1.5e-36 of PyTorch's (gates below
    -87 give -0, as PyTorch does below -88.7: the clamped exponential once turned a gate of -3e38
    into -5.6), and non-finite gates give what PyTorch gives."""
    width = 1024 + 3  # 64 rows of 16-lane loops, then 3 scalar ends a row
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = torch.cat([gates, gates[: 64 * width - 65536]]).reshape(64, width)
    out = ops.silu_and_mul(torch.cat([gates, torch.ones_like(gates)], dim=1).contiguous())
    expected = torch.nn.functional.silu(gates)
    g, e = gates.float(), expected.float()
    normal = (g.abs() >= 1e-30) & (g.abs() <= 80)  # exp(-80) and its products stay normal floats
    assert normal.sum() > 27_000
    assert torch.equal(out[normal].view(torch.int16), expected[normal].view(torch.int16))
    finite = torch.isfinite(g)
    outside = finite & ~normal
    assert torch.all((out.float()[outside] - e[outside]).abs() < torch.finfo(torch.float32).tiny * 2**7)
    assert torch.equal(out[~finite].isnan(), expected[~finite].isnan())
    assert torch.equal(out[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()])


def test_layers_fall_back_for_what_the_kernels_do_not_take(ops, cpu_ops, monkeypatch):
    norm, act = RMSNorm(16, 1e-6, cpu_ops), SiluAndMul(cpu_ops)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    x = torch.randn(4, 16, dtype=torch.float64)
    assert not ops.supports(x) and not ops.supports(torch.randn(4, 32)[:, ::2])
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul"):
        monkeypatch.setattr(ops, name, lambda *a: pytest.fail("a kernel was called on a tensor it does not take"))
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps), atol=1e-6, rtol=1e-6)
    out, residual = norm(x, x.float())  # the residual's dtype differs from x's
    torch.testing.assert_close(residual, 2 * x)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(act(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (37, 4, 4, 32), (600, 8, 2, 128)])
def test_rope_and_cache_write_equal_pytorch_rotation_and_index_copy(ops, dtype, num_tokens, heads, kv_heads, head_dim):
    """Bit for bit: each product and sum is rounded as PyTorch's rotate() rounds it, in both dtypes."""
    torch.manual_seed(num_tokens + heads)
    rope = get_rope(head_dim, 4096, {"rope_theta": 10000.0})
    positions = torch.randint(0, 4096, (num_tokens,))
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim) * 3).to(dtype)
    block_size, num_blocks = 16, num_tokens // 16 + 8
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm((num_blocks - 1) * block_size)[:num_tokens] + block_size  # block 0 stays null
    qk = rotate(qkv[:, : (heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim), cos, sin)
    expected_cache = cache.clone()
    expected_cache[0].view(-1, kv_heads, head_dim)[slots] = qk[:, heads:]
    expected_cache[1].view(-1, kv_heads, head_dim)[slots] = qkv[:, (heads + kv_heads) * head_dim :].view(
        num_tokens, kv_heads, head_dim)
    out = qkv.clone()
    ops.rope_and_cache(out, cos, sin, slots, cache, heads, kv_heads, head_dim)
    assert torch.equal(out[:, : (heads + kv_heads) * head_dim].view_as(qk), qk)
    assert torch.equal(out[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :])
    assert torch.equal(cache, expected_cache)


def test_attention_layer_takes_the_fused_path_only_where_it_applies(ops, monkeypatch):
    """The same layer call on the PyTorch ops (rotate, then the backend writes the cache) and on the
    CPU ops (one kernel rotates and writes): the same cache bit for bit and the same attention."""
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    backend = TorchAttentionBackend()
    common = CommonAttentionMetadata(torch.tensor([0, 3]), torch.tensor([3]), torch.tensor([4, 5, 6]),
                                     torch.tensor([[1, 0]]), block_size, [3], [3])
    metadata = backend.build_metadata(common)
    rope = get_rope(head_dim, 64, {}).cos_sin(torch.arange(3), torch.float32)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim)
    calls, kernel = [], ops.rope_and_cache
    monkeypatch.setattr(ops, "rope_and_cache", lambda *a: calls.append(a) or kernel(*a))

    def run(layer_ops, qkv, rope, dtype=torch.float32):
        attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5, backend, layer_ops)
        attn.kv_cache = torch.zeros(2, 8, block_size, kv_heads, head_dim, dtype=dtype)
        return attn(qkv.clone(), rope, metadata), attn.kv_cache

    expected, expected_cache = run(TorchLayerOps(), qkv, rope)
    assert not calls
    fused, fused_cache = run(CpuLayerOps(ops), qkv, rope)
    assert len(calls) == 1
    assert torch.equal(fused_cache, expected_cache)
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=1e-6)
    # float64: no kernel, the PyTorch rotation and the backend's cache write
    rope64 = tuple(t.double() for t in rope)
    out64, cache64 = run(CpuLayerOps(ops), qkv.double(), rope64, torch.float64)
    assert len(calls) == 1
    reference64, reference_cache64 = run(TorchLayerOps(), qkv.double(), rope64, torch.float64)
    assert torch.equal(out64, reference64) and torch.equal(cache64, reference_cache64)
    torch.testing.assert_close(out64.float(), expected, atol=1e-5, rtol=1e-5)
