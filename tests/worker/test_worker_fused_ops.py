"""The fused CPU layers (csrc/fused_ops.c) against the PyTorch code of the same modules."""
from __future__ import annotations

import pytest
import torch

from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.layers.activation import SiluAndMul
from services.worker.layers.fused_ops import FusedOps, use_fused_ops
from services.worker.layers.layernorm import RMSNorm


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> FusedOps:
    library = load_cpu_kernels(tmp_path_factory.mktemp("kernels"))
    assert library is not None, "the CPU kernels must build here (gcc is on every CI machine)"
    return FusedOps(library)


def _tolerance(dtype):
    # float32: summation order only; bfloat16: one rounding step of the result.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (7, 64), (300, 200), (2048, 576)])
def test_rms_norm_with_and_without_residual_matches_pytorch(ops, dtype, num_tokens, hidden):
    torch.manual_seed(num_tokens + hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(num_tokens, hidden) * 3).to(dtype)
    residual = torch.randn(num_tokens, hidden).to(dtype)
    expected_alone = norm(x)
    expected, expected_residual = norm(x, residual)
    use_fused_ops(norm, ops)
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
@pytest.mark.parametrize("num_tokens,width", [(1, 3072), (5, 2 * 13), (64, 3072), (2048, 3072)])
def test_silu_and_mul_matches_pytorch(ops, dtype, num_tokens, width):
    torch.manual_seed(num_tokens + width)
    x = (torch.randn(num_tokens, width) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    act = SiluAndMul()
    expected = act(x)
    use_fused_ops(act, ops)
    out = act(x)
    assert out.shape == (num_tokens, width // 2) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


def test_layers_fall_back_for_what_the_kernels_do_not_take(ops):
    norm, act = RMSNorm(16), SiluAndMul()
    with torch.no_grad():
        norm.weight.fill_(1.0)
    use_fused_ops(norm, ops), use_fused_ops(act, ops)
    x = torch.randn(4, 16, dtype=torch.float64)
    assert not ops.supports(x) and not ops.supports(torch.randn(4, 32)[:, ::2])
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps), atol=1e-6, rtol=1e-6)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(act(x), torch.nn.functional.silu(gate) * up)
