"""Weight-only int8 on the AMX GEMM (csrc/gemm_amx_bf16.c's int8 panels, layers/amx_gemm.py): its
products where the CPU has AMX, and on every machine the per-shape rows (timing stubbed), which int8
weights take it and which rows `Int8Weight.linear` sends to it."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from services.worker.layers.amx_gemm import INT8_ROW_GRID, AmxGemm, AmxInt8Weight, AmxRowSelector, use_amx_int8
from services.worker.layers.int8_kernels import dequantize, quantize_per_channel
from services.worker.layers.int8_linear import Int8Weight
from services.worker.layers.linear import Linear
from services.worker.platforms import cpu as cpu_platform
from tests.worker.test_amx_gemm import amx  # noqa: F401 (the fixture: the kernel, or a skip without AMX)


def _int8(num_out: int, num_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=gen) * torch.rand(num_out, 1, generator=gen)
    return quantize_per_channel(weight)


# M: one row, a partial row tile, one and two full blocks, more than a 32-row block (each block widens
# the panel again); N: whole panels, a partial panel, fewer columns than one tile; K: 32 to 1536.
@pytest.mark.parametrize("num_rows,num_out,num_in", [(1, 64, 576), (17, 960, 576), (48, 3072, 576),
                                                     (33, 576, 1536), (64, 100, 64), (100, 7, 32), (300, 40, 96)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_products_are_the_int8_weights_sums_scaled_and_rounded_once(amx, num_rows, num_out, num_in, has_bias):
    qweight, scales = _int8(num_out, num_in, seed=num_rows * 1000 + num_out)
    gen = torch.Generator().manual_seed(num_in)
    x = torch.randn(num_rows, num_in, generator=gen).bfloat16()
    bias = torch.randn(num_out, generator=gen).bfloat16() if has_bias else None
    out = amx(x, amx.pack_int8(qweight, scales, 0), bias)
    # int8 values are bfloat16 exactly: the sums are x's against the integers, then the scale.
    reference = (x.double() @ qweight.double().t()) * scales.double() + (bias.double() if has_bias else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, num_out)
    torch.testing.assert_close(out.double(), reference, rtol=2 ** -8, atol=1e-4)


def test_int8_weights_the_kernel_cannot_read_in_place_are_not_supported():
    assert AmxGemm.supports_int8(torch.zeros(8, 64, dtype=torch.int8), None)
    assert AmxGemm.supports_int8(torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, dtype=torch.bfloat16))
    assert not AmxGemm.supports_int8(torch.zeros(8, 48, dtype=torch.int8), None)  # K not a multiple of 32
    assert not AmxGemm.supports_int8(torch.zeros(8, 64, dtype=torch.bfloat16), None)  # not int8
    assert not AmxGemm.supports_int8(torch.zeros(64, 8, dtype=torch.int8).t(), None)  # not contiguous
    assert not AmxGemm.supports_int8(torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8))  # float32 bias


def _stub_timing(monkeypatch, wins_from: int, wins_to: int) -> list[int]:
    timed: list[int] = []

    def timing(self, int8, gemm):
        def wins(num_rows: int) -> bool:
            timed.append(num_rows)
            return wins_from <= num_rows <= wins_to

        return wins

    monkeypatch.setattr(AmxRowSelector, "_int8_timing", timing)
    return timed


class _Gemv:
    """Stands in for the int8 GEMV: only its presence matters to the row split."""


@pytest.mark.parametrize("wins_from,wins_to,has_gemv,expected", [
    (4, 256, True, (2, 256)),  # the GEMV keeps the grid's counts below the first win
    (2, 512, True, (1, 512)),
    (24, 64, True, (16, 64)),  # never more than the GEMV's own limit (16 here)
    (4, 256, False, (0, 256)),  # no GEMV: the kernel takes every row count up to its limit
    (10**6, 0, True, (16, 0)),  # never wins: the GEMV keeps its rows, the kernel none
])
def test_the_kernel_starts_where_it_first_wins_and_ends_before_two_losses(monkeypatch, wins_from, wins_to, has_gemv,
                                                                          expected):
    _stub_timing(monkeypatch, wins_from, wins_to)
    int8 = Int8Weight(*_int8(48, 64, seed=1), native_bf16=True)
    int8.gemv = _Gemv() if has_gemv else None
    assert AmxRowSelector().int8_rows(int8, None) == expected


def test_int8_rows_are_stored_per_machine_and_read_back_after_a_restart(tmp_path, monkeypatch):
    cache = tmp_path / cpu_platform.AMX_ROWS_FILE
    timed = _stub_timing(monkeypatch, 8, 128)
    int8 = Int8Weight(*_int8(96, 64, seed=2), native_bf16=True)
    int8.gemv = _Gemv()
    assert AmxRowSelector(cache_path=cache).int8_rows(int8, None) == (4, 128)
    assert timed == [r for r in INT8_ROW_GRID if r <= 8] + [r for r in INT8_ROW_GRID if 8 <= r <= 256]
    stored = json.loads(cache.read_text())
    assert sorted(name.split("/", 4)[-1] for name in stored) == ["int8w-amx/96x64/from", "int8w-amx/96x64/to"]
    timed.clear()
    assert AmxRowSelector(cache_path=cache).int8_rows(int8, None) == (4, 128) and not timed


class RecordingGemm:
    """Stands in for AmxGemm: packs a plain copy, records the rows of each call, multiplies in float32."""

    def __init__(self):
        self.calls: list[int] = []

    def pack_int8(self, qweight, scales, max_rows, allocate=None) -> AmxInt8Weight:
        return AmxInt8Weight(qweight.clone(), scales.float(), qweight.shape[0], qweight.shape[1], max_rows)

    def __call__(self, x, weight: AmxInt8Weight, bias=None):
        self.calls.append(x.shape[0])
        out = x.float() @ dequantize(weight.data, weight.scales).t()
        return (out + bias.float() if bias is not None else out).to(x.dtype)


def _int8_layers() -> nn.ModuleList:
    layers = nn.ModuleList([Linear(64, 32), Linear(48, 32), Linear(96, 16)])
    for i, layer in enumerate(layers):
        layer.use_int8(Int8Weight(*_int8(*layer.weight.shape, seed=i), native_bf16=True))
    return layers


def test_int8_layers_take_the_kernel_between_their_gemv_rows_and_its_limit(monkeypatch):
    _stub_timing(monkeypatch, 1, 64)
    layers, gemm = _int8_layers(), RecordingGemm()
    layers[2].int8_weight.w8a8 = object()  # W8A8 multiplies on its own kernels: not taken
    assert use_amx_int8(layers, gemm, AmxRowSelector()) == 1  # 48 inputs: not a multiple of 32
    assert layers[1].int8_weight.amx_weight is None and layers[2].int8_weight.amx_weight is None
    int8 = layers[0].int8_weight
    assert int8.amx_gemm is gemm and int8.amx_weight.max_rows == 64 and int8.max_gemv_rows == 0  # no GEMV here
    for num_rows in (1, 64, 65):
        x = torch.randn(num_rows, 64).bfloat16()
        expected = x.float() @ dequantize(int8.qweight, int8.scales).t()
        with torch.no_grad():
            torch.testing.assert_close(layers[0](x).float(), expected, rtol=2 ** -6, atol=2e-2)
    assert gemm.calls == [1, 64]  # 65 rows: past the limit, the weight's own path
    gemm.calls.clear()
    layers[0](torch.randn(4, 64))  # float32 activations keep the int8 paths
    assert gemm.calls == []


def test_an_int8_shape_the_kernel_never_wins_stays_off_it(monkeypatch):
    _stub_timing(monkeypatch, 10**6, 0)
    layers = _int8_layers()
    assert use_amx_int8(layers, RecordingGemm(), AmxRowSelector()) == 0
    assert all(layer.int8_weight.amx_weight is None for layer in layers)
