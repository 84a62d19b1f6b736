"""The compiled int8 GEMV (csrc/gemv_int8.c) against a float64 matmul on the dequantized weight, in
the build for this CPU and the portable x86-64-v3 one; `Int8Weight.linear` taking it for a few
rows and the PyTorch int8 paths above; the platform's wiring (the LM head included, --cpu-gemv,
no library); and greedy tokens of tiny int8 models with it."""
from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker import cpu_kernels
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import WorkerConfig
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.gemv import Gemv
from services.worker.layers.int8_gemv import MAX_INT8_GEMV_ROWS, Int8Gemv
from services.worker.layers.int8_kernels import dequantize, quantize_per_channel
from services.worker.layers import int8_linear
from services.worker.layers.int8_linear import Int8PathSelector, Int8Weight, quantize_model
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.layers.linear import Linear
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms.cpu import CpuPlatform
from tests.worker import test_quantized_model
from tests.worker.cpu_features import onednn_packs_bf16
from tests.worker.kernel_builds import MARCHES, library_for
from tests.worker.test_quantized_model import _greedy

_gemvs: dict[str, Int8Gemv] = {}


def _gemv(march: str, kernel_cache) -> Int8Gemv:
    """The kernel built for this CPU (with AVX512_BF16, bfloat16 x multiplies on VDPBF16PS) or the
    portable build an image ships (int8 and x widened to float32, AVX2 FMAs)."""
    if march not in _gemvs:
        _gemvs[march] = Int8Gemv(library_for(march, kernel_cache))
    return _gemvs[march]


@pytest.fixture(params=MARCHES)
def gemv(request, kernel_cache) -> Int8Gemv:
    return _gemv(request.param, kernel_cache)


@pytest.fixture
def native_gemv(kernel_cache) -> Int8Gemv:
    return _gemv("native", kernel_cache)


class CountingInt8Gemv(Int8Gemv):
    """Counts the rows of each call, then multiplies."""

    def __init__(self, inner: Int8Gemv):
        self.__dict__.update(inner.__dict__)
        self.calls: list[int] = []

    def __call__(self, x, qweight, scales, bias=None):
        self.calls.append(x.shape[0])
        return super().__call__(x, qweight, scales, bias)


def _int8_weight(num_out: int, num_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=g) * torch.rand(num_out, 1, generator=g)  # rows of unequal range
    return quantize_per_channel(weight)


def _reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ (qweight.double() * scales.double()[:, None]).t()
    return out + bias.double() if bias is not None else out


# K: SmolLM2's 576 and 1536 (whole 64-byte lines), 100 and 7 (a masked or scalar tail, shorter than
# a vector); N odd, so the last rows of Q fall outside every block height.
@pytest.mark.parametrize("num_out,num_in", [(37, 576), (131, 1536), (9, 100), (1001, 7), (1, 64)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("has_bias", [False, True])
def test_gemv_matches_a_float64_matmul_on_the_dequantized_weight(gemv, num_out, num_in, x_dtype, has_bias):
    qweight, scales = _int8_weight(num_out, num_in, seed=num_out * num_in)
    bias = torch.randn(num_out).to(x_dtype) if has_bias else None
    for num_rows in [*range(1, MAX_INT8_GEMV_ROWS + 1), 17]:  # from 9: more than one pass of 8 x rows
        x = torch.randn(num_rows, num_in, generator=torch.Generator().manual_seed(num_rows)).to(x_dtype)
        out = gemv(x, qweight, scales, bias)
        assert out.dtype == x_dtype and out.shape == (num_rows, num_out)
        expected = _reference(x, qweight, scales, bias)
        # float32 sums in another order: a few float32 ulps of the sum of |products|.
        bound = (x.double().abs() @ (qweight.double().abs() * scales.double()[:, None]).t()) * 2e-6 + 1e-6
        if x_dtype == torch.bfloat16:  # plus the output's rounding, at most a bfloat16 half ulp (2^-8)
            bound = bound + expected.abs() * 2.0**-8
        error = (out.double() - expected).abs()
        assert (error <= bound).all(), (num_rows, error.max().item())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemv_scales_adds_the_bias_and_rounds_once_as_pytorch_does(gemv, x_dtype):
    """Exact products and sums (small integers, power-of-two scales) leave only the final
    rounding, which must agree with PyTorch's rounding of the exact result."""
    g = torch.Generator().manual_seed(0)
    qweight = torch.randint(-127, 128, (45, 200), generator=g, dtype=torch.int8)
    scales = torch.exp2(torch.randint(-6, 2, (45,), generator=g).float())
    x = (torch.randint(-8, 9, (5, 200), generator=g) * 1.0078125).to(x_dtype)  # 129/128: bf16 keeps 8 bits
    bias = torch.randint(-64, 65, (45,), generator=g).to(x_dtype)
    assert torch.equal(gemv(x, qweight, scales, bias), _reference(x, qweight, scales, bias).to(x_dtype))


def test_a_bias_in_another_dtype_or_strided_x_still_multiplies(native_gemv):
    qweight, scales = _int8_weight(50, 96, seed=3)
    x = torch.randn(96, 3).t().bfloat16()  # not contiguous
    bias = torch.randn(50)  # float32 beside bfloat16 x: added after the kernel
    out = native_gemv(x, qweight, scales, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(x, qweight, scales, bias).float(), atol=0.05, rtol=2**-7)


def test_gemv_refuses_what_it_cannot_multiply(native_gemv):
    qweight, scales = _int8_weight(8, 16, seed=0)
    for dtype in Int8Gemv.DTYPES:  # no rows: an empty result, not an error
        assert native_gemv(torch.empty(0, 16, dtype=dtype), qweight, scales).shape == (0, 8)
    with pytest.raises(ValueError):
        native_gemv(torch.randn(2, 16).half(), qweight, scales)
    with pytest.raises(ValueError):
        native_gemv(torch.randn(2, 15), qweight, scales)
    assert Int8Gemv.supports_weight(qweight, scales)
    assert not Int8Gemv.supports_weight(qweight.t(), scales)  # not contiguous
    assert not Int8Gemv.supports_weight(qweight, scales.bfloat16())
    with_min = qweight.clone()
    with_min[2, 5] = -128  # outside the widening table: the PyTorch paths keep such a weight
    assert not Int8Gemv.supports_weight(with_min, scales)
    int8 = Int8Weight(with_min, scales, native_bf16=True)
    assert not int8.use_gemv(native_gemv) and int8.gemv is None


def _assert_close_to_float32(out, x, qweight, scales, bias):
    """Within float32 rounding, or for bfloat16 x within the paths' roundings: the output and the bias
    add (a step each, 2^-8 of the value), and the widening path's weights in bfloat16 (2^-9 of each
    product, up to 2^-9 of the sum of |products|)."""
    weight = dequantize(qweight, scales)
    expected = F.linear(x.float(), weight, bias.float())
    if x.dtype == torch.float32:
        torch.testing.assert_close(out.float(), expected, atol=1e-4, rtol=1e-5)
        return
    magnitude = x.float().abs() @ weight.abs().t()
    bound = 2**-7 * expected.abs() + 2**-8 * magnitude + 1e-3
    assert ((out.float() - expected).abs() <= bound).all(), f"largest excess {(out.float() - expected).abs().max()}"


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_takes_the_gemv_up_to_the_row_limit_and_the_pytorch_paths_above(native_gemv, x_dtype):
    counting = CountingInt8Gemv(native_gemv)
    qweight, scales = _int8_weight(96, 64, seed=1)
    int8 = Int8Weight(qweight, scales, native_bf16=True, max_int8pack_rows=16)
    assert int8.use_gemv(counting) and int8.gemv is counting
    gen = torch.Generator().manual_seed(5)  # not the global generator: the data must not depend on test order
    bias = torch.randn(96, generator=gen).to(x_dtype)
    for num_rows in (1, MAX_INT8_GEMV_ROWS, MAX_INT8_GEMV_ROWS + 1, 32):
        counting.calls.clear()
        x = torch.randn(num_rows, 64, generator=gen).to(x_dtype)
        out = int8.linear(x, bias)
        assert counting.calls == ([num_rows] if num_rows <= MAX_INT8_GEMV_ROWS else [])
        _assert_close_to_float32(out, x, qweight, scales, bias)
    counting.calls.clear()
    int8.linear(torch.randn(1, 64).to(x_dtype), use_int8pack=True)  # the start-up timing names its kernel
    int8.linear(torch.randn(1, 64).to(x_dtype), use_int8pack=False)
    assert counting.calls == []
    int8.max_gemv_rows = 64  # as the selector sets it where the GEMV won up to 64 rows
    for num_rows in (32, 64, 65):
        counting.calls.clear()
        x = torch.randn(num_rows, 64, generator=gen).to(x_dtype)
        out = int8.linear(x, bias)
        assert counting.calls == ([num_rows] if num_rows <= 64 else [])
        _assert_close_to_float32(out, x, qweight, scales, bias)


@pytest.mark.parametrize("gemv_loses_from,expected", [
    (32, MAX_INT8_GEMV_ROWS),  # the other path wins past 16 rows: the default limit stays
    (128, 64),
    (256, 128),  # one loss at the grid's end: nothing left to confirm it
    (None, 256),  # the GEMV wins at every count timed: the grid's last
])
def test_the_selector_raises_the_gemv_limit_to_the_last_row_count_it_wins(native_gemv, monkeypatch, gemv_loses_from,
                                                                           expected):
    timed = []

    def fake_time(self, fn):  # the GEMV first, then the layer's other path
        num_rows = int8_linear.GEMV_ROW_GRID[len(timed) // 2]
        is_gemv = len(timed) % 2 == 0
        timed.append(num_rows)
        gemv_wins = gemv_loses_from is None or num_rows < gemv_loses_from
        return 1.0 if gemv_wins == is_gemv else 2.0

    monkeypatch.setattr(Int8PathSelector, "_best_time", fake_time)
    int8 = Int8Weight(*_int8_weight(96, 64, seed=1), native_bf16=True, max_int8pack_rows=16)
    assert int8.use_gemv(native_gemv)
    selector = Int8PathSelector()
    assert selector.max_gemv_rows(int8, torch.bfloat16) == expected
    assert selector.max_gemv_rows(int8, torch.bfloat16) == expected and len(timed) <= 2 * len(int8_linear.GEMV_ROW_GRID)


def test_quantize_model_gives_each_weight_its_measured_gemv_limit(native_gemv, monkeypatch):
    monkeypatch.setattr(Int8PathSelector, "max_gemv_rows",
                        lambda self, weight, dtype: 32 if weight.shape[0] == 40 else 64)
    modules = _tied_layers()
    layer, _, head = modules
    summary = quantize_model(modules, torch.float32, native_bf16=True, selector=Int8PathSelector(num_repeats=1),
                             gemv=native_gemv)
    assert (layer.int8_weight.max_gemv_rows, head.int8_weight.max_gemv_rows) == (32, 64)
    assert summary.endswith(", 2 on the int8 GEMV up to 32-64 rows")


def _tied_layers() -> nn.ModuleList:
    torch.manual_seed(0)
    layer, embedding = Linear(96, 40, bias=True), VocabEmbedding(70, 96)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_(), embedding.weight.normal_()
    return nn.ModuleList([layer, embedding, LMHead(70, 96, tied_to=embedding)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_platform_hands_the_gemv_to_every_int8_weight_the_lm_head_included(native_gemv, dtype):
    counting = CountingInt8Gemv(native_gemv)
    platform = CpuPlatform(dtype, TorchAttentionBackend(), TorchLayerOps(), float32_copy=False, native_bf16=True,
                           quantization="int8", int8_selector=Int8PathSelector(num_repeats=1), int8_gemv=counting)
    modules = _tied_layers().to(dtype)
    layer, embedding, head = modules
    summary = platform.process_weights_after_loading(modules)
    assert re.search(r", 2 on the int8 GEMV up to \d+(-\d+)? rows$", summary)
    assert layer.int8_weight.gemv is counting and head.int8_weight.gemv is counting
    assert embedding.int8_weight is head.int8_weight
    counting.calls.clear()  # the selector timed the GEMV through it
    x = torch.randn(3, 96).to(dtype)
    logits = head(x)
    assert counting.calls == [3]
    expected = x.float() @ dequantize(head.int8_weight.qweight, head.int8_weight.scales).t()
    torch.testing.assert_close(logits.float(), expected, atol=0.05, rtol=2**-7)


def test_cpu_gemv_false_and_a_missing_library_leave_the_pytorch_int8_paths(kernel_cache, monkeypatch):
    heads = AttentionHeads(4, 2, 64)
    on = build_platform(WorkerConfig(cache_dir=str(kernel_cache), quantization="int8"), torch.device("cpu"),
                        torch.bfloat16, heads)
    assert isinstance(on.int8_gemv, Int8Gemv)
    off = build_platform(WorkerConfig(cache_dir=str(kernel_cache), quantization="int8", cpu_gemv=False),
                         torch.device("cpu"), torch.bfloat16, heads)
    assert off.int8_gemv is None and off.gemv is None
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)  # no compiler, nothing prebuilt
    monkeypatch.delenv("CC", raising=False)
    missing = build_platform(WorkerConfig(cache_dir=str(kernel_cache / "empty"), quantization="int8"),
                             torch.device("cpu"), torch.bfloat16, heads)
    assert missing.int8_gemv is None
    for platform in (off, missing):
        modules = _tied_layers().to(torch.bfloat16)
        summary = platform.process_weights_after_loading(modules)
        assert "GEMV" not in summary and modules[0].int8_weight.gemv is None and modules[2].int8_weight.gemv is None


# --- Whole models ---------------------------------------------------------------------------------

dequantized_dirs = test_quantized_model.dequantized_dirs  # tiny Llamas whose weights are int8 values


def _int8_runner(model_dir, dtype: torch.dtype, int8_gemv: Int8Gemv | None, monkeypatch):
    """test_quantized_model's runner, its platform handed `int8_gemv`, which keeps the default row
    limit (MAX_INT8_GEMV_ROWS: prefill chunks of more rows take the PyTorch int8 paths)."""
    monkeypatch.setattr(test_quantized_model, "CpuPlatform", functools.partial(CpuPlatform, int8_gemv=int8_gemv))
    monkeypatch.setattr(Int8PathSelector, "max_gemv_rows", lambda self, weight, dtype: MAX_INT8_GEMV_ROWS)
    return test_quantized_model._runner(model_dir, dtype, "int8")


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_int8_model_on_the_gemv_gives_the_greedy_tokens_of_the_dequantized_float32_model(
        dequantized_dirs, kind, native_gemv, monkeypatch):
    """Decode steps of 4 requests run 4 rows on the GEMV, prefill chunks of up to 32 the PyTorch
    int8 paths; the weights are int8 values, so the float32 model on them is the reference."""
    model_dir = dequantized_dirs[kind]
    expected = _greedy(test_quantized_model._runner(model_dir, torch.float32, "none"))
    counting = CountingInt8Gemv(native_gemv)
    runner = _int8_runner(model_dir, torch.float32, counting, monkeypatch)
    assert _greedy(runner) == expected
    assert counting.calls and max(counting.calls) <= MAX_INT8_GEMV_ROWS


def test_bf16_int8_model_on_the_gemv_gives_the_tokens_of_the_bf16_gemv(dequantized_dirs, native_gemv, kernel_cache,
                                                                       monkeypatch):
    """With bfloat16 activations both GEMVs sum the same exact products in float32 and round once
    (the weights' int8 values times power-of-two scales are exact in bfloat16)."""
    model_dir = dequantized_dirs["bf16_exact"]
    library = library_for("native", kernel_cache)
    monkeypatch.setattr(test_quantized_model, "CpuPlatform", functools.partial(CpuPlatform, gemv=Gemv(library)))
    # The bf16 model's prefill: oneDNN bf16 where it packs bf16, else the float32 copy (AVX2); both
    # sum in float32 and round once.
    native = onednn_packs_bf16()
    expected = _greedy(test_quantized_model._runner(model_dir, torch.bfloat16, "none", native_bf16=native,
                                                    float32_copy=not native), 8)
    counting = CountingInt8Gemv(native_gemv)
    assert _greedy(_int8_runner(model_dir, torch.bfloat16, counting, monkeypatch), 8) == expected
    assert counting.calls
