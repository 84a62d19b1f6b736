"""The compiled GEMV (csrc/gemv.c) and the column tiles (csrc/gemm_tiles.c, AVX512_BF16 builds)
against a float32 matmul of the same bfloat16 values, the dispatch of `LinearBase.forward` to them,
the platform without the library, and greedy tokens of a tiny Llama and Qwen2 in bfloat16 with the
GEMV on and off."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from services.worker import cpu_kernels
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import WorkerConfig
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.gemv import Gemv, use_gemv
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.layers.linear import MAX_GEMV_ROWS, MAX_TILE_ROWS, Linear
from services.worker.layers.tile_rows import TileRowSelector
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms import cpu as cpu_platform
from services.worker.platforms.cpu import CpuPlatform
from tests.worker import harness
from tests.worker.cpu_features import needs_bf16_packing


@pytest.fixture(scope="module")
def gemv(kernel_cache) -> Gemv:
    library = cpu_kernels.load_cpu_kernels(kernel_cache)
    if library is None:
        pytest.skip("the CPU kernels did not build here")
    return Gemv(library)


@pytest.fixture(scope="module")
def tiles(gemv) -> Gemv:
    if not gemv.has_tiles:
        pytest.skip("the CPU kernels have no column tiles here (built without AVX512_BF16)")
    return gemv


class CountingGemv(Gemv):
    """Counts the rows of each call, on the plain GEMV or the tiles, then multiplies."""

    def __init__(self, inner: Gemv):
        self.__dict__.update(inner.__dict__)
        self.calls: list[int] = []

    def __call__(self, x, weight, bias=None):
        self.calls.append(x.shape[0])
        return super().__call__(x, weight, bias)

    def tiles(self, x, weight, bias=None):
        self.calls.append(x.shape[0])
        return super().tiles(x, weight, bias)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().t()
    return out + bias.float() if bias is not None else out


# K: a multiple of 32, not one (a scalar or masked tail), shorter than one vector; N: a multiple
# of the 4-row block, not one, fewer rows than a block.
@pytest.mark.parametrize("num_out,num_in", [(64, 576), (37, 100), (3, 7), (130, 1536), (1000, 45)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("has_bias", [False, True])
def test_gemv_matches_a_float32_matmul_of_the_same_values(gemv, num_out, num_in, x_dtype, has_bias):
    torch.manual_seed(num_out * num_in)
    weight = torch.randn(num_out, num_in).bfloat16()
    bias = torch.randn(num_out).bfloat16() if has_bias else None
    for num_rows in range(1, 7):  # 5 and 6 pass over a weight block twice
        x = torch.randn(num_rows, num_in).to(x_dtype)
        out = gemv(x, weight, bias)
        assert out.dtype == x_dtype and out.shape == (num_rows, num_out)
        expected = _reference(x, weight, bias)
        # float32 sums in another order: a few float32 ulps of the sum of |products|.
        bound = (x.float().abs() @ weight.float().abs().t()) * 1e-6 + 1e-6
        if x_dtype == torch.bfloat16:  # plus the output's rounding, half a bfloat16 ulp
            bound = bound + expected.abs() * 2.0**-8
        assert ((out.float() - expected).abs() <= bound).all(), (num_rows, (out.float() - expected).abs().max())


# N: a multiple of the 16-column tile and of the 3-tile panel, neither, fewer than a tile; K: odd
# (a last pair of one), shorter than a pair's vector; rows: within one 8-row block, across blocks.
@pytest.mark.parametrize("num_out,num_in", [(96, 576), (37, 101), (3, 7), (130, 1536), (1000, 45), (20, 1)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_tiles_match_a_float32_matmul_of_the_same_values(tiles, num_out, num_in, has_bias):
    torch.manual_seed(num_out * num_in)
    weight = torch.randn(num_out, num_in).bfloat16()
    bias = torch.randn(num_out).bfloat16() if has_bias else None
    tiled = tiles.pack_tiles(weight)
    for num_rows in (1, 2, 7, 8, 9, 17, 64):
        x = torch.randn(num_rows, num_in).bfloat16()
        out = tiles.tiles(x, tiled, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (num_rows, num_out)
        expected = _reference(x, weight, bias)
        bound = (x.float().abs() @ weight.float().abs().t()) * 1e-6 + 1e-6 + expected.abs() * 2.0**-8
        assert ((out.float() - expected).abs() <= bound).all(), (num_rows, (out.float() - expected).abs().max())


def test_tiles_round_as_pytorch_does_and_refuse_what_they_cannot_multiply(tiles):
    torch.manual_seed(0)
    weight = torch.randint(-8, 9, (50, 96)).bfloat16()
    x = torch.randint(-8, 9, (11, 96)).bfloat16() * 1.0078125  # sums need 15 bits, bf16 keeps 8
    bias = torch.randint(-4, 5, (50,)).bfloat16()
    tiled = tiles.pack_tiles(weight)
    assert torch.equal(tiles.tiles(x, tiled, bias), _reference(x, weight, bias).bfloat16())
    with pytest.raises(ValueError):
        tiles.tiles(x.float(), tiled)  # bfloat16 activations only
    with pytest.raises(ValueError):
        tiles.tiles(x[:, :95], tiled)


def test_gemv_rounds_bfloat16_outputs_as_pytorch_does(gemv):
    """Exact products and sums (small integers) leave only the final rounding, which must agree."""
    torch.manual_seed(0)
    weight = torch.randint(-8, 9, (50, 96)).bfloat16()
    x = torch.randint(-8, 9, (3, 96)).bfloat16() * 1.0078125  # 129/128: sums need 15 bits, bf16 keeps 8
    bias = torch.randint(-4, 5, (50,)).bfloat16()
    assert torch.equal(gemv(x, weight, bias), _reference(x, weight, bias).bfloat16())


def test_gemv_refuses_what_it_cannot_multiply(gemv):
    weight = torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError):
        gemv(torch.randn(2, 16).half(), weight)
    with pytest.raises(ValueError):
        gemv(torch.randn(2, 15).bfloat16(), weight)
    assert Gemv.supports_weight(weight, None) and Gemv.supports_weight(weight, torch.zeros(8).bfloat16())
    assert not Gemv.supports_weight(weight.float(), None)
    assert not Gemv.supports_weight(weight.t(), None)  # not contiguous
    assert not Gemv.supports_weight(weight, torch.zeros(8))  # a float32 bias


def _bf16_layer_and_head() -> nn.ModuleList:
    torch.manual_seed(0)
    layer, embedding = Linear(96, 40, bias=True), VocabEmbedding(70, 96)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_(), embedding.weight.normal_()
    return nn.ModuleList([layer, LMHead(70, 96, tied_to=embedding)]).to(torch.bfloat16)


@pytest.mark.parametrize("native_bf16", [pytest.param(True, marks=needs_bf16_packing), False])
def test_linear_takes_the_gemv_for_a_few_rows_and_onednn_or_the_copy_above(gemv, native_bf16):
    counting = CountingGemv(gemv)
    platform = CpuPlatform(torch.bfloat16, TorchAttentionBackend(), TorchLayerOps(), float32_copy=True,
                           native_bf16=native_bf16, gemv=counting)
    modules = _bf16_layer_and_head()
    plain = [m.weight.detach().clone() for m in modules]
    summary = platform.process_weights_after_loading(modules)
    max_rows = gemv.max_tile_rows if gemv.has_tiles else MAX_GEMV_ROWS
    assert summary.endswith(f", 2 in column tiles up to {max_rows} rows" if gemv.has_tiles
                            else f", 2 on the GEMV up to {MAX_GEMV_ROWS} rows")
    assert summary.startswith("2 matmul weights prepacked, 0" if native_bf16 else "0 matmul weights prepacked, 2")
    for module, weight in zip(modules, plain):
        assert module.gemv is counting and module.packed_weight is not None
        assert (module.gemv_tiles is not None) == gemv.has_tiles
        # The GEMV needs the plain weight; the tiles replace it, unless a tied embedding reads it or
        # nothing packed it (the float32 copy sits beside it).
        keeps_plain = not gemv.has_tiles or module.keeps_weight_when_packed or not native_bf16
        assert torch.equal(module.weight, weight) if keeps_plain else module.weight.numel() == 0
        for num_rows in (1, MAX_GEMV_ROWS, MAX_GEMV_ROWS + 1, 17, max_rows, max_rows + 1):
            counting.calls.clear()
            x = torch.randn(num_rows, 96).bfloat16()
            out = module(x)
            assert counting.calls == ([num_rows] if num_rows <= max_rows else [])
            bias = module.bias
            expected = _reference(x, weight, bias)
            assert torch.allclose(out.float(), expected, rtol=2**-7, atol=1e-2)


def test_float32_and_int8_free_layers_do_not_take_the_gemv(gemv):
    platform = CpuPlatform(torch.float32, TorchAttentionBackend(), TorchLayerOps(), float32_copy=True,
                           native_bf16=True, gemv=gemv)
    modules = _bf16_layer_and_head().float()
    assert platform.process_weights_after_loading(modules) == "2 matmul weights prepacked, 0 with a float32 copy"
    assert all(m.gemv is None for m in modules)
    assert use_gemv(nn.ModuleList([Linear(8, 8)]), gemv) == 0  # a float32 weight


def test_without_the_library_there_is_no_gemv_and_linear_stays_on_pytorch(kernel_cache, monkeypatch):
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)  # no compiler, nothing prebuilt
    monkeypatch.delenv("CC", raising=False)
    config = WorkerConfig(cache_dir=str(kernel_cache / "empty"))
    platform = build_platform(config, torch.device("cpu"), torch.bfloat16, AttentionHeads(4, 2, 64))
    assert platform.gemv is None
    modules = _bf16_layer_and_head()
    weight, bias = modules[0].weight.detach().clone(), modules[0].bias.detach().clone()
    summary = platform.process_weights_after_loading(modules)
    assert "GEMV" not in summary and all(m.gemv is None for m in modules)
    x = torch.randn(1, 96).bfloat16()
    assert torch.allclose(modules[0](x).float(), _reference(x, weight, bias), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])  # Qwen2: biased QKV
@pytest.mark.parametrize("native_bf16", [pytest.param(True, marks=needs_bf16_packing), False])
def test_greedy_tokens_of_a_bf16_model_are_the_same_with_the_gemv_on_and_off(model_fixture, gemv, native_bf16,
                                                                              request, monkeypatch):
    """Decode steps of 4 requests run 4 rows on the GEMV; it sums in float32 and rounds once, as
    oneDNN's bfloat16 GEMM and the float32 copy do, so the tokens agree."""
    model_dir = request.getfixturevalue(model_fixture)
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: native_bf16)
    generator = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(3, harness.VOCAB_SIZE, (n,), generator=generator).tolist()
               for i, n in enumerate([23, 9, 41, 16])}
    without = _bf16_greedy_tokens(model_dir, prompts)
    counting = CountingGemv(gemv)
    monkeypatch.setattr(harness, "CpuPlatform", functools.partial(CpuPlatform, gemv=counting))
    with_gemv = _bf16_greedy_tokens(model_dir, prompts)
    assert counting.calls and max(counting.calls) <= (gemv.max_tile_rows if gemv.has_tiles else MAX_GEMV_ROWS)
    assert with_gemv == without
    assert all(len(tokens) == 8 for tokens in with_gemv.values())


def _bf16_greedy_tokens(model_dir, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    runner = harness.make_runner(model_dir, block_size=4, dtype=torch.bfloat16, float32_copy=True)
    scheduler = harness.MiniScheduler(block_size=4, token_budget=32)
    for req_id, prompt in prompts.items():
        scheduler.add(req_id, prompt, max_tokens=8)
    scheduler.run(runner)
    return {req_id: scheduler.outputs(req_id) for req_id in prompts}


def test_cpu_gemv_off_keeps_every_weight_packed_only(kernel_cache):
    """--cpu-gemv false: the kernels load, but no layer keeps its plain weight for the GEMV."""
    config = WorkerConfig(cache_dir=str(kernel_cache), cpu_gemv=False)
    platform = build_platform(config, torch.device("cpu"), torch.bfloat16, AttentionHeads(4, 2, 64))
    assert platform.gemv is None
    assert build_platform(WorkerConfig(cache_dir=str(kernel_cache)), torch.device("cpu"), torch.bfloat16,
                          AttentionHeads(4, 2, 64)).gemv is not None
    untiled = build_platform(WorkerConfig(cache_dir=str(kernel_cache), cpu_gemm_tiles=False), torch.device("cpu"),
                             torch.bfloat16, AttentionHeads(4, 2, 64))
    assert untiled.gemv is not None and not untiled.gemv.has_tiles  # --cpu-gemm-tiles false: the plain GEMV
    modules = _bf16_layer_and_head()
    assert "GEMV" not in platform.process_weights_after_loading(modules)
    assert all(m.gemv is None for m in modules)


def test_with_amx_each_shape_takes_the_tiles_up_to_its_measured_limit(kernel_cache, monkeypatch):
    """oneDNN multiplies on AMX where the CPU has it: each weight shape's row limit on the tiles is
    then measured (tile_rows.py, timing stubbed here); without AMX it is MAX_TILE_ROWS, untimed."""
    measured = []

    def measure(self, weight, tiled, gemv):
        measured.append((tiled.n_size, tiled.k_size))
        return 16 if tiled.n_size == 40 else 32

    monkeypatch.setattr(TileRowSelector, "_measure", measure)
    monkeypatch.setattr(cpu_platform, "cpu_has_amx_bf16", lambda: True)
    platform = build_platform(WorkerConfig(cache_dir=str(kernel_cache)), torch.device("cpu"), torch.bfloat16,
                              AttentionHeads(4, 2, 64))
    assert platform.tile_rows.is_measured and platform.gemv.max_tile_rows == MAX_TILE_ROWS
    if platform.gemv.has_tiles:
        modules = _bf16_layer_and_head()
        summary = platform.process_weights_after_loading(modules)
        assert [m.gemv_tiles.max_rows for m in modules] == [16, 32] and sorted(measured) == [(40, 96), (70, 96)]
        assert summary.endswith(", 2 in column tiles up to 16-32 (by shape) rows")
        assert (kernel_cache / cpu_platform.TILE_ROWS_FILE).is_file()  # kept for the next start
    monkeypatch.setattr(cpu_platform, "cpu_has_amx_bf16", lambda: False)
    measured.clear()
    platform = build_platform(WorkerConfig(cache_dir=str(kernel_cache)), torch.device("cpu"), torch.bfloat16,
                              AttentionHeads(4, 2, 64))
    assert not platform.tile_rows.is_measured
    if platform.gemv.has_tiles:
        modules = _bf16_layer_and_head()
        platform.process_weights_after_loading(modules)
        assert all(m.gemv_tiles.max_rows == MAX_TILE_ROWS for m in modules) and not measured
