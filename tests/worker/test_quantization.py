"""Weight-only int8: the quantizer, both matmul paths against a float reference of the dequantized
weight, the per-call choice by row count and its start-up measurement, the embedding lookup on
int8 rows, and the flag's wiring through the worker config and the platforms."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import WorkerConfig, config_from_args
from services.worker.layers import int8_linear
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.int8_kernels import dequantize, has_int8pack_mm, int8pack_linear, quantize_per_channel
from services.worker.layers.int8_linear import NO_LIMIT, Int8PathSelector, Int8Weight, quantize_model
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.layers.linear import Linear, QKVLinear
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms.cpu import CpuPlatform
from services.worker.platforms.cuda import CudaPlatform


def _weight(num_out: int = 96, num_in: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_out, num_in, generator=g) * torch.rand(num_out, 1, generator=g)  # rows of unequal range
    w[3] = 0.0  # an all-zero row
    return w


def test_per_channel_quantization_is_symmetric_absmax_over_127():
    w = _weight()
    qweight, scales = quantize_per_channel(w)
    assert qweight.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (96,)
    nonzero = torch.arange(96) != 3
    torch.testing.assert_close(scales[nonzero], w[nonzero].abs().amax(dim=1) / 127)
    assert scales[3] == 1.0 and (qweight[3] == 0).all()
    assert (qweight.abs().amax(dim=1)[nonzero] == 127).all()  # each row's largest value maps to +-127
    assert ((dequantize(qweight, scales) - w).abs() <= scales[:, None] / 2 + 1e-7).all()


def _int8(native_bf16: bool = True, num_in: int = 64, max_rows: int = 4) -> Int8Weight:
    return Int8Weight(*quantize_per_channel(_weight(num_in=num_in)), native_bf16=native_bf16,
                      max_int8pack_rows=max_rows)


@pytest.mark.parametrize("native_bf16", [True, False])  # False: the AVX2 fallback widens to float32
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("use_int8pack", [True, False])
def test_each_path_matches_the_dequantized_float_weight(native_bf16, dtype, atol, use_int8pack):
    int8 = _int8(native_bf16)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(1)).to(dtype)  # not the global RNG's state
    for num_rows in (1, 3, 17, 64):
        x = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(num_rows)).to(dtype)
        expected = F.linear(x.float(), dequantize(int8.qweight, int8.scales), bias.float())
        out = int8.linear(x, bias, use_int8pack=use_int8pack)
        assert out.dtype == dtype and out.shape == (num_rows, 96)
        # bf16: the output's own rounding (values up to ~25 are 0.125 apart) dominates the tolerance.
        torch.testing.assert_close(out.float(), expected, atol=atol, rtol=2**-7 if dtype == torch.bfloat16 else 1e-5)


def test_the_path_follows_the_row_count(monkeypatch):
    calls = []
    monkeypatch.setattr(int8_linear, "int8pack_linear", lambda x, q, s: calls.append(("int8pack", x.shape[0]))
                        or torch.zeros(x.shape[0], q.shape[0], dtype=x.dtype))
    monkeypatch.setattr(int8_linear, "dequantize_chunks_linear", lambda x, q, s, c: calls.append(("widen", x.shape[0], c))
                        or torch.zeros(x.shape[0], q.shape[0], dtype=x.dtype))
    for native_bf16 in (True, False):
        int8 = _int8(native_bf16, max_rows=4)
        for num_rows in (1, 4, 5, 32):
            int8.linear(torch.zeros(num_rows, 64, dtype=torch.bfloat16))
    assert calls == [("int8pack", 1), ("int8pack", 4), ("widen", 5, torch.bfloat16), ("widen", 32, torch.bfloat16),
                     ("int8pack", 1), ("int8pack", 4), ("widen", 5, torch.float32), ("widen", 32, torch.float32)]


def test_input_sizes_int8pack_mm_mishandles_always_widen():
    # torch 2.13's int8pack_mm returns NaN or wrong sums (or crashes) unless the input size is a multiple of 16.
    int8 = _int8(num_in=40, max_rows=NO_LIMIT)
    assert int8.max_int8pack_rows == 0 and Int8PathSelector().max_int8pack_rows(int8, torch.bfloat16) == 0
    x = torch.randn(2, 40)
    torch.testing.assert_close(int8.linear(x), F.linear(x, dequantize(int8.qweight, int8.scales)), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("offset_elements", [1, 4, 8, 16, 32])
def test_int8pack_takes_rows_that_do_not_start_on_the_allocators_boundary(offset_elements):
    """torch's int8pack_mm crashed the process on such a view (2-16 bytes past 32); it gets a copy."""
    if not has_int8pack_mm():
        pytest.skip("no int8pack_mm in this torch")
    qweight, scales = quantize_per_channel(_weight())
    rows = torch.randn(17 * 64 + 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    x = rows[offset_elements:offset_elements + 17 * 64].view(17, 64)
    got = int8pack_linear(x, qweight, scales.bfloat16())
    assert torch.equal(got, int8pack_linear(x.clone(), qweight, scales.bfloat16()))


@pytest.mark.parametrize("widened_wins_from,expected", [
    (None, NO_LIMIT),  # int8pack_mm fastest everywhere
    (1, 0),  # the widening GEMM fastest everywhere
    (16, 8),
    (256, 128),  # only the last grid point lost: one loss is not two in a row, but nothing is left to confirm it
])
def test_the_selector_keeps_the_last_row_count_before_the_widening_path_wins(monkeypatch, widened_wins_from, expected):
    timed = []

    def fake_time(self, fn):  # the two candidates alternate: int8pack_mm, then the widening path
        is_widened = len(timed) % 2 == 1
        num_rows = int8_linear.ROW_GRID[len(timed) // 2]
        timed.append(num_rows)
        wins = widened_wins_from is not None and num_rows >= widened_wins_from
        return 1.0 if wins == is_widened else 2.0

    monkeypatch.setattr(Int8PathSelector, "_best_time", fake_time)
    selector = Int8PathSelector()
    int8 = _int8()
    assert selector.max_int8pack_rows(int8, torch.bfloat16) == expected
    assert selector.max_int8pack_rows(_int8(), torch.bfloat16) == expected  # measured once per shape
    stop = len(int8_linear.ROW_GRID) if widened_wins_from in (None, 256) else \
        int8_linear.ROW_GRID.index(widened_wins_from) + 2
    assert len(timed) == 2 * stop and set(selector.thresholds) == {(96, 64, torch.bfloat16, torch.bfloat16)}


def test_a_real_measurement_gives_a_threshold_on_the_grid():
    threshold = Int8PathSelector(num_repeats=1).max_int8pack_rows(_int8(), torch.float32)
    assert threshold == NO_LIMIT or threshold in (0, *int8_linear.ROW_GRID)


def _tied_model(dtype: torch.dtype) -> nn.ModuleList:
    torch.manual_seed(0)
    embedding = VocabEmbedding(80, 64)
    qkv, o = QKVLinear(64, 16, 2, 1, bias=True), Linear(64, 64)
    with torch.no_grad():
        for p in (embedding.weight, qkv.weight, qkv.bias, o.weight):
            p.normal_()
    return nn.ModuleList([embedding, qkv, o, LMHead(80, 64, tied_to=embedding)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_model_frees_the_float_weights_and_the_tied_embedding_reads_int8_rows(dtype):
    modules = _tied_model(dtype)
    embedding, qkv, o, head = modules
    expected = {name: quantize_per_channel(m.weight) for name, m in (("qkv", qkv), ("o", o), ("head", head))}
    summary = quantize_model(modules, dtype, native_bf16=True, selector=Int8PathSelector(num_repeats=1))
    assert summary.startswith("3 matmul weights int8 (0 from the checkpoint's Q8_0)") and "1 tied embedding" in summary
    for name, layer in (("qkv", qkv), ("o", o), ("head", head)):
        assert layer.weight.numel() == 0 and layer.int8_weight is not None and layer.packed_weight is None
        assert torch.equal(layer.int8_weight.qweight, expected[name][0])
    assert embedding.weight.numel() == 0 and embedding.int8_weight is head.int8_weight
    ids = torch.tensor([0, 5, 79, 5])
    rows = embedding(ids)
    assert rows.dtype == dtype
    torch.testing.assert_close(rows, dequantize(*expected["head"], dtype)[ids], atol=0, rtol=0)
    x = torch.randn(3, 64).to(dtype)
    torch.testing.assert_close(qkv(x).float(), F.linear(x.float(), dequantize(*expected["qkv"]), qkv.bias.float()),
                               atol=0.05, rtol=2**-7)


def test_the_flag_and_its_environment_variable(monkeypatch):
    assert WorkerConfig().quantization == "none" and config_from_args([]).quantization == "none"
    assert config_from_args(["--quantization", "int8"]).quantization == "int8"
    monkeypatch.setenv("SPINDLE_QUANTIZATION", "int8")
    assert config_from_args([]).quantization == "int8"
    with pytest.raises(ValueError, match="--quantization 'int4'"):
        WorkerConfig(quantization="int4")
    with pytest.raises(SystemExit):
        config_from_args(["--quantization", "fp8"])


def test_the_cpu_platform_quantizes_instead_of_packing(tmp_path):
    platform = build_platform(WorkerConfig(quantization="int8", attention_backend="torch", cache_dir=str(tmp_path)),
                              torch.device("cpu"), torch.float32, AttentionHeads(4, 2, 16))
    assert isinstance(platform, CpuPlatform) and platform.quantization == "int8"
    modules = _tied_model(torch.float32)
    assert platform.process_weights_after_loading(modules).startswith("3 matmul weights int8")
    assert all(m.int8_weight is not None and not m.weight_is_packed for m in modules[1:])
    plain = CpuPlatform(torch.float32, TorchAttentionBackend(), TorchLayerOps(), float32_copy=False)
    assert plain.quantization == "none"
    assert plain.process_weights_after_loading(_tied_model(torch.float32)).startswith("3 matmul weights prepacked")


def test_the_cuda_platform_refuses_int8():
    with pytest.raises(ValueError, match="CPU only"):
        CudaPlatform.from_config(WorkerConfig(quantization="int8"), torch.device("cuda"), torch.bfloat16,
                                 AttentionHeads(4, 2, 16))


def test_thresholds_are_stored_per_machine_and_reused_after_a_restart(tmp_path, monkeypatch):
    """The kernels round differently: a restart must not re-time its way to other greedy tokens."""
    cache = tmp_path / "int8_kernel_thresholds.json"
    monkeypatch.setattr(Int8PathSelector, "_measure", lambda self, weight, dtype: 8)
    assert Int8PathSelector(cache_path=cache).max_int8pack_rows(_int8(), torch.bfloat16) == 8
    assert list(json.loads(cache.read_text()).values()) == [8]

    def no_timing(self, weight, dtype):
        raise AssertionError("timed again")

    monkeypatch.setattr(Int8PathSelector, "_measure", no_timing)
    assert Int8PathSelector(cache_path=cache).max_int8pack_rows(_int8(), torch.bfloat16) == 8
    cache.write_text("not json")  # an unreadable store is measured again, and rewritten
    monkeypatch.setattr(Int8PathSelector, "_measure", lambda self, weight, dtype: 2)
    assert Int8PathSelector(cache_path=cache).max_int8pack_rows(_int8(), torch.bfloat16) == 2
    assert list(json.loads(cache.read_text()).values()) == [2]


def test_the_cpu_platform_stores_thresholds_in_the_cache_dir(tmp_path):
    platform = build_platform(WorkerConfig(quantization="int8", attention_backend="torch", cache_dir=str(tmp_path)),
                              torch.device("cpu"), torch.float32, AttentionHeads(4, 2, 16))
    assert platform.int8_selector.cache_path == tmp_path / "int8_kernel_thresholds.json"


def test_int8_with_tensor_parallelism_is_refused_at_start_up():
    from services.worker.config import WorkerConfig

    with pytest.raises(ValueError, match="not supported with --tensor-parallel-size"):
        WorkerConfig(quantization="int8", tensor_parallel_size=2)
    assert WorkerConfig(quantization="int8").quantization == "int8"
