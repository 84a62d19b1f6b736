"""The AMX-BF16 GEMM (csrc/gemm_amx_bf16.c, layers/amx_gemm.py): its products where the CPU has AMX,
and on every machine the per-shape row limit (timing stubbed), which layers take it and which rows
`LinearBase.forward` sends to it."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from services.worker import cpu_kernels
from services.worker.config import WorkerConfig, cpu_has_amx_bf16
from services.worker.layers.amx_gemm import ROW_GRID, AmxGemm, AmxRowSelector, AmxWeight, use_amx_gemm
from services.worker.layers.gemv import TiledWeight
from services.worker.layers.kernel_timing import last_win
from services.worker.layers.linear import Linear
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms import cpu as cpu_platform


@pytest.fixture(scope="module")
def amx(kernel_cache) -> AmxGemm:
    library = cpu_kernels.load_cpu_kernels(kernel_cache)
    if library is None:
        pytest.skip("the CPU kernels did not build here")
    gemm = AmxGemm(library)
    if not gemm.available:
        pytest.skip("no AMX-BF16 here (or the kernel refused the tile state)")
    return gemm


# M: one row, a partial row tile, one and two full blocks and a tail, more than a 32-row block;
# N: a multiple of the 32-column panel, a partial panel, fewer columns than one tile; K: 32 to 1536.
@pytest.mark.parametrize("num_rows,num_out,num_in", [(1, 64, 576), (17, 960, 576), (48, 3072, 576),
                                                     (33, 576, 1536), (64, 100, 64), (100, 7, 32), (300, 40, 96)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_products_match_a_float32_matmul_rounded_once(amx, num_rows, num_out, num_in, has_bias):
    gen = torch.Generator().manual_seed(num_rows * 1000 + num_out)
    weight = (torch.randn(num_out, num_in, generator=gen) * 0.05).bfloat16()
    x = torch.randn(num_rows, num_in, generator=gen).bfloat16()
    bias = torch.randn(num_out, generator=gen).bfloat16() if has_bias else None
    out = amx(x, amx.pack(weight, 0), bias)
    reference = x.float() @ weight.float().t() + (bias.float() if has_bias else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, num_out)
    # One rounding to bfloat16 (half a step, 2^-9 of the value) over float32 sums in another order.
    torch.testing.assert_close(out.float(), reference, rtol=2 ** -8, atol=1e-4)


def test_a_view_of_x_is_multiplied_as_its_values_and_bad_inputs_are_refused(amx):
    weight = (torch.randn(64, 64) * 0.05).bfloat16()
    packed = amx.pack(weight, 0)
    wide = torch.randn(20, 128).bfloat16()
    x = wide[:, 32:96]  # not contiguous: copied first
    torch.testing.assert_close(amx(x, packed).float(), x.float() @ weight.float().t(), rtol=2 ** -8, atol=1e-4)
    with pytest.raises(ValueError, match="AMX GEMM"):
        amx(x.float(), packed)
    with pytest.raises(ValueError, match="AMX GEMM"):
        amx(torch.randn(4, 32).bfloat16(), packed)


def test_weights_the_kernel_cannot_read_in_place_are_not_supported():
    assert AmxGemm.supports_weight(torch.zeros(8, 64, dtype=torch.bfloat16), None)
    assert not AmxGemm.supports_weight(torch.zeros(8, 48, dtype=torch.bfloat16), None)  # K not a multiple of 32
    assert not AmxGemm.supports_weight(torch.zeros(8, 64), None)  # float32
    assert not AmxGemm.supports_weight(torch.zeros(64, 8, dtype=torch.bfloat16).t(), None)  # not contiguous
    assert not AmxGemm.supports_weight(torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8))  # float32 bias


def _stub_timing(monkeypatch, amx_wins_up_to: int) -> list[int]:
    timed: list[int] = []

    def measure(self, weight, gemm, min_rows):
        def wins(num_rows: int) -> bool:
            timed.append(num_rows)
            return num_rows <= amx_wins_up_to

        return last_win(tuple(r for r in ROW_GRID if r > min_rows), wins, 0)[0]

    monkeypatch.setattr(AmxRowSelector, "_measure", measure)
    return timed


@pytest.mark.parametrize("amx_wins_up_to, min_rows, limit, num_timed",
                         [(128, 8, 128, 8), (512, 8, 512, 10), (0, 8, 0, 2), (64, 32, 64, 4)])
def test_the_limit_is_the_last_win_before_onednn_wins_twice(monkeypatch, amx_wins_up_to, min_rows, limit, num_timed):
    timed = _stub_timing(monkeypatch, amx_wins_up_to)
    selector = AmxRowSelector()
    assert selector.max_rows(torch.empty(48, 64), None, min_rows) == limit
    assert len(timed) == num_timed and min(timed) > min_rows  # rows the tiles take are not timed
    assert selector.max_rows(torch.empty(48, 64), None, min_rows) == limit and len(timed) == num_timed


def test_limits_are_stored_per_machine_and_read_back_after_a_restart(tmp_path, monkeypatch):
    cache = tmp_path / cpu_platform.AMX_ROWS_FILE
    timed = _stub_timing(monkeypatch, 64)
    assert AmxRowSelector(cache_path=cache).max_rows(torch.empty(96, 64), None, 8) == 64
    stored = json.loads(cache.read_text())
    assert len(stored) == 1 and next(iter(stored)).endswith("/bf16-amx/96x64") and 64 in stored.values()
    timed.clear()
    assert AmxRowSelector(cache_path=cache).max_rows(torch.empty(96, 64), None, 8) == 64 and not timed


class RecordingGemm:
    """Stands in for AmxGemm: packs nothing, records the rows of each call, multiplies in float32."""

    def __init__(self):
        self.calls: list[int] = []
        self.weights: dict[int, torch.Tensor] = {}

    def pack(self, weight: torch.Tensor, max_rows: int, allocate=None) -> AmxWeight:
        data = weight.detach().clone()
        return AmxWeight(data, weight.shape[0], weight.shape[1], max_rows)

    def __call__(self, x, weight: AmxWeight, bias=None):
        self.calls.append(x.shape[0])
        out = x.float() @ weight.data.float().t()
        return (out + bias.float() if bias is not None else out).to(x.dtype)


def _layers() -> nn.ModuleList:
    layers = nn.ModuleList([Linear(64, 32), Linear(48, 32), Linear(96, 16)])
    for layer in layers:
        nn.init.normal_(layer.weight, std=0.05)
        layer.weight.data = layer.weight.data.bfloat16()
    return layers


def test_layers_take_the_kernel_between_the_tiles_rows_and_their_limit(monkeypatch):
    _stub_timing(monkeypatch, 64)
    layers, gemm = _layers(), RecordingGemm()
    layers[2].gemv_tiles = TiledWeight(torch.empty(0), 16, 96, 8)  # the tiles take up to 8 rows
    assert use_amx_gemm(layers, gemm, AmxRowSelector()) == 2  # 48 inputs: not a multiple of 32
    assert layers[1].amx_weight is None and layers[0].amx_weight.max_rows == 64
    assert layers[2].amx_weight.max_rows == 64 and layers[2].amx_gemm is gemm
    layer = layers[0]
    for num_rows in (1, 64, 65):
        x = torch.randn(num_rows, 64).bfloat16()
        with torch.no_grad():
            torch.testing.assert_close(layer(x).float(), x.float() @ layer.weight.float().t(), rtol=2 ** -7,
                                       atol=1e-3)
    assert gemm.calls == [1, 64]  # 65 rows: past the limit, the layer's own path


def test_a_shape_the_kernel_never_wins_stays_off_it(monkeypatch):
    _stub_timing(monkeypatch, 0)
    layers = _layers()
    assert use_amx_gemm(layers, RecordingGemm(), AmxRowSelector()) == 0
    assert all(layer.amx_weight is None for layer in layers)


@pytest.mark.parametrize("amx_flag", [True, False])
def test_the_platform_uses_the_kernel_only_for_bfloat16_on_amx_and_when_asked(kernel_cache, amx_flag):
    config = WorkerConfig(cache_dir=str(kernel_cache), cpu_amx_gemm=amx_flag)
    bf16 = build_platform(config, torch.device("cpu"), torch.bfloat16, AttentionHeads(4, 2, 64))
    float32 = build_platform(config, torch.device("cpu"), torch.float32, AttentionHeads(4, 2, 64))
    assert float32.amx_gemm is None
    library = cpu_kernels.load_cpu_kernels(kernel_cache)
    has_amx = library is not None and cpu_has_amx_bf16() and AmxGemm(library).available
    assert (bf16.amx_gemm is not None) == (amx_flag and has_amx)
