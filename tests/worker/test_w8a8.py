"""`--quantization w8a8`: the compiled passes around `torch._int_mm` (csrc/w8a8.c) on both builds,
the matmul against the exact product of its quantized operands, the row counts each path takes, the
refusals, and a whole tiny model's greedy tokens against transformers in float32.

The documented agreement for the model (docs/benchmarks.md, "W8A8"): every greedy token is within
the float32 reference's top 3 at its position (teacher forcing), and at least 90% of them are the
reference's own argmax."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.int8_kv_cache import quantize_int8_rows
from services.worker.config import RunnerConfig, WorkerConfig, cpu_has_int8_dot
from services.worker.kv_cache import KVCacheLayout
from services.worker.layers.int8_gemv import MAX_INT8_GEMV_ROWS, Int8Gemv
from services.worker.layers.int8_kernels import quantize_per_channel
from services.worker.layers.int8_linear import Int8Weight
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.layers.w8a8 import W8A8Kernels, int_mm_is_exact
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms.cpu import CpuPlatform
from services.worker.attention.torch_backend import TorchAttentionBackend
from tests.top_k_agreement import check_within_reference_top_k
from tests.worker.harness import VOCAB_SIZE, MiniScheduler, save_llama_head_dim_64
from tests.worker.kernel_builds import MARCHES, library_for

TOP_K = 3
MIN_ARGMAX_SHARE = 0.9
VNNI_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}
needs_exact_int_mm = pytest.mark.skipif(not int_mm_is_exact(),
                                        reason="torch._int_mm is not exact on this CPU")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(f.read().split())


@pytest.fixture(params=MARCHES)
def kernels(request, kernel_cache) -> W8A8Kernels:
    return W8A8Kernels(library_for(request.param, kernel_cache))


# --- the compiled passes --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantize_bit_for_bit_as_the_reference(kernels, dtype):
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(9, 1100, generator=g) * torch.logspace(-3, 2, 9)[:, None]).to(dtype)
    x = wide[:, 7:7 + 1037]  # rows a stride apart, an odd length
    x[2] = 0.0  # a row of zeros: scale 0, all zeros
    x[4, 5] = float("nan")  # a NaN becomes 0, not undefined behaviour
    q, scales = kernels.quantize_rows(x)
    ref_q, ref_scales = quantize_int8_rows(x)
    assert torch.equal(q, ref_q) and torch.equal(scales, ref_scales)
    assert q.abs().max() == 127 and scales[2] == 0 and q[2].abs().max() == 0 and q[4, 5] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int32_sums_scale_back_within_one_rounding(kernels, dtype, with_bias):
    g = torch.Generator().manual_seed(1)
    acc = torch.randint(-2**20, 2**20, (40, 333), generator=g, dtype=torch.int32)
    x_scales, w_scales = torch.rand(40, generator=g) / 100, torch.rand(333, generator=g) / 100
    bias = torch.randn(333, generator=g).to(dtype) if with_bias else None
    out = kernels.dequantize(acc, x_scales, w_scales, bias, dtype)
    ref = acc.double() * (x_scales[:, None] * w_scales[None, :]).double()
    if bias is not None:
        ref = ref + bias.double()
    assert out.dtype == dtype
    # float32 arithmetic, then one rounding to the output dtype (a fused multiply-add may skip one).
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=1e-30)


# --- the matmul -------------------------------------------------------------------------------------
@needs_exact_int_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [17, 64, 300])
def test_w8a8_linear_is_the_product_of_its_quantized_operands(kernels, dtype, num_rows):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(num_rows, 200, generator=g).to(dtype)
    qweight, scales = quantize_per_channel(torch.randn(96, 200, generator=g))
    bias = torch.randn(96, generator=g).to(dtype)
    out = kernels.linear(x, qweight, scales, bias)
    xq, x_scales = quantize_int8_rows(x)
    exact = (xq.double() * x_scales.double()[:, None]) @ (qweight.double() * scales.double()[:, None]).t()
    assert out.dtype == dtype and out.shape == (num_rows, 96)
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), exact + bias.double(), rtol=rtol, atol=1e-4)
    # ... and near the float product: the activations' rounding is the only other error.
    float_out = x.float() @ (qweight.float() * scales[:, None]).t() + bias.float()
    assert ((out.float() - float_out).norm() / float_out.norm()) < 0.02


def test_int_mm_probe_catches_wrong_or_missing_sums(monkeypatch):
    if VNNI_FLAGS & _cpu_flags():
        assert int_mm_is_exact()  # oneDNN multiplies on VNNI/AMX here
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: real(a, b).clamp(-2**15, 2**15 - 1))  # 16-bit saturation
    assert not int_mm_is_exact()

    def unsupported(a, b):
        raise RuntimeError("_int_mm: not implemented")

    monkeypatch.setattr(torch, "_int_mm", unsupported)
    assert not int_mm_is_exact()


# --- which rows take which path ------------------------------------------------------------------
class _Spy:
    def __init__(self, real):
        self.real, self.rows = real, []

    def __call__(self, x, *args):
        self.rows.append(x.shape[0])
        return self.real(x, *args)


@needs_exact_int_mm
def test_rows_off_the_gemv_take_w8a8_and_keep_their_shape(kernel_cache):
    library = library_for("native", kernel_cache)
    qweight, scales = quantize_per_channel(torch.randn(64, 128))
    weight = Int8Weight(qweight, scales, native_bf16=True)
    gemv, kernels = Int8Gemv(library), W8A8Kernels(library)
    assert weight.use_gemv(gemv)
    weight.w8a8 = kernels
    gemv_spy, w8a8_spy = _Spy(gemv.__call__), _Spy(kernels.linear)
    weight.gemv, kernels.linear = gemv_spy, w8a8_spy
    for num_rows in (1, MAX_INT8_GEMV_ROWS, MAX_INT8_GEMV_ROWS + 1, 200):
        assert weight.linear(torch.randn(num_rows, 128).bfloat16()).shape == (num_rows, 64)
    assert gemv_spy.rows == [1, MAX_INT8_GEMV_ROWS] and w8a8_spy.rows == [MAX_INT8_GEMV_ROWS + 1, 200]
    out = weight.linear(torch.randn(3, 7, 128))  # more than 16 rows in 3-D: flattened, shape restored
    assert out.shape == (3, 7, 64) and out.dtype == torch.float32 and w8a8_spy.rows[-1] == 21
    weight.gemv = None  # a weight the GEMV does not take: every row count on w8a8
    weight.linear(torch.randn(2, 128))
    assert w8a8_spy.rows[-1] == 2


# --- refusals -------------------------------------------------------------------------------------
def test_w8a8_is_refused_with_tensor_parallelism_and_without_the_kernels():
    assert WorkerConfig(quantization="w8a8").quantization == "w8a8"
    with pytest.raises(ValueError, match="--quantization w8a8 is not supported with --tensor-parallel-size"):
        WorkerConfig(quantization="w8a8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="w8a8 needs the compiled CPU kernels"):
        CpuPlatform(torch.float32, TorchAttentionBackend(), TorchLayerOps(), float32_copy=False, quantization="w8a8")


def test_w8a8_is_refused_without_int8_dot_products(monkeypatch, kernel_cache):
    monkeypatch.setattr("services.worker.platforms.cpu.cpu_has_int8_dot", lambda: False)
    heads = AttentionHeads(num_heads=4, num_kv_heads=2, head_dim=64)
    config = WorkerConfig(quantization="w8a8", cache_dir=str(kernel_cache))
    with pytest.raises(ValueError, match=r"w8a8 needs int8 dot products .* use --quantization int8"):
        build_platform(config, torch.device("cpu"), torch.bfloat16, heads)
    assert cpu_has_int8_dot() == bool(VNNI_FLAGS & _cpu_flags())


def test_w8a8_is_refused_where_int_mm_is_not_exact(monkeypatch, kernel_cache):
    monkeypatch.setattr("services.worker.platforms.cpu.cpu_has_int8_dot", lambda: True)
    monkeypatch.setattr("services.worker.platforms.cpu.int_mm_is_exact", lambda: False)
    heads = AttentionHeads(num_heads=4, num_kv_heads=2, head_dim=64)
    config = WorkerConfig(quantization="w8a8", cache_dir=str(kernel_cache))
    with pytest.raises(ValueError, match="torch._int_mm does not multiply int8 exactly on this CPU"):
        build_platform(config, torch.device("cpu"), torch.bfloat16, heads)


# --- a whole model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The random init's attention: on the sharpened variant of the int8 KV tests, bf16 with every
    # matmul on W8A8 put one token of 96 at the reference's rank 4 (docs/benchmarks.md, "W8A8").
    return save_llama_head_dim_64(tmp_path_factory.mktemp("llama-w8a8"), sharpen_attention=False)


def _runner(model_dir, dtype: torch.dtype, cache_dir, cpu_gemv: bool) -> ModelRunner:
    hf_config = load_config(model_dir)
    worker_config = WorkerConfig(quantization="w8a8", cache_dir=str(cache_dir), cpu_gemv=cpu_gemv)
    platform = build_platform(worker_config, torch.device("cpu"), dtype, AttentionHeads.from_hf_config(hf_config))
    model = load_model(model_dir, platform, config=hf_config)
    attn = model.attention_layers()
    layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, 16, dtype)
    config = RunnerConfig(block_size=16, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048)
    runner = ModelRunner(model, config, torch.device("cpu"), platform.attention_backend, layout,
                         vocab_size=hf_config.vocab_size, eos_token_ids=(2,))
    runner.initialize_kv_cache(64)
    return runner


@needs_exact_int_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpu_gemv", [True, False])  # False: every matmul quantizes its activations
def test_w8a8_greedy_tokens_stay_within_the_float32_references_top_k(model_dir, dtype, cpu_gemv, kernel_cache,
                                                                       monkeypatch):
    # Where the worker refuses w8a8 for speed alone (exact, no VNNI) the numbers are still checked.
    monkeypatch.setattr("services.worker.platforms.cpu.cpu_has_int8_dot", lambda: True)
    runner = _runner(model_dir, dtype, kernel_cache, cpu_gemv)
    head = runner.model.lm_head.int8_weight
    assert head.w8a8 is not None and (head.gemv is not None) == cpu_gemv
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (70, 9, 150, 33)]
    scheduler = MiniScheduler(block_size=16, token_budget=64)  # chunked prefills beside decodes
    for i, prompt in enumerate(prompts):
        scheduler.add(f"req-{i}", prompt, max_tokens=24)
    scheduler.run(runner)
    outputs = [scheduler.outputs(f"req-{i}") for i in range(len(prompts))]
    check_within_reference_top_k(model_dir, prompts, outputs, TOP_K, MIN_ARGMAX_SHARE, 24)
