"""The worker's platforms: what each picks for a configuration and a model's heads, how it packs
weights, and that a model built on a platform calls its layer ops in every layer (given at
construction, not found by a scan afterwards)."""
from __future__ import annotations

import collections
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from services.worker import cpu_kernels
from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cupy_backend import CupyAttentionBackend
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import RunnerConfig, WorkerConfig
from services.worker.cuda_sampler import CudaSampler
from services.worker.kv_cache import KVCacheLayout, allocate_kv_caches
from services.worker.layers.activation import SiluAndMul
from services.worker.layers.attention import Attention
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.fused_ops import CpuLayerOps
from services.worker.layers.layer_ops import LayerOps, TorchLayerOps
from services.worker.layers.layernorm import RMSNorm
from services.worker.layers.linear import Linear
from services.worker.model_loader import load_config, load_model
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms import cpu as cpu_platform
from services.worker.platforms.cpu import CpuPlatform
from services.worker.platforms.cuda import CudaPlatform
from services.worker.sampler import TorchSampler
from services.worker.worker import Worker
from tests.worker.cpu_features import needs_bf16_packing

HEADS = AttentionHeads(num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("flag,dtype,heads,backend_cls,ops_cls", [
    ("auto", torch.float32, HEADS, CpuAttentionBackend, CpuLayerOps),
    ("auto", torch.bfloat16, HEADS, CpuAttentionBackend, CpuLayerOps),
    ("auto", torch.float32, AttentionHeads(4, 2, 60), TorchAttentionBackend, CpuLayerOps),  # no decode kernel
    ("auto", torch.float16, HEADS, TorchAttentionBackend, CpuLayerOps),  # no float16 decode kernel
    ("torch", torch.float32, HEADS, TorchAttentionBackend, TorchLayerOps),
])
def test_cpu_platform_picks_the_compiled_kernels_where_they_serve(kernel_cache, flag, dtype, heads, backend_cls,
                                                                   ops_cls):
    config = WorkerConfig(attention_backend=flag, cache_dir=str(kernel_cache), kv_cache_bytes=3 * 2**20)
    platform = build_platform(config, torch.device("cpu"), dtype, heads)
    assert isinstance(platform, CpuPlatform) and platform.device == torch.device("cpu") and platform.dtype == dtype
    assert type(platform.attention_backend) is backend_cls and type(platform.layer_ops) is ops_cls
    assert type(platform.sampler) is TorchSampler
    layout = KVCacheLayout(2, heads.num_kv_heads, heads.head_dim, 16, dtype)
    runner_config = RunnerConfig(block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    assert platform.kv_cache_bytes(nn.Module(), layout, runner_config) == 3 * 2**20  # the flag's budget as it is


def test_cpu_platform_without_the_kernel_library_is_pytorch_throughout(kernel_cache, monkeypatch):
    monkeypatch.setattr(cpu_platform, "load_cpu_kernels", lambda cache_dir: None)  # a failed build
    platform = build_platform(WorkerConfig(cache_dir=str(kernel_cache)), torch.device("cpu"), torch.float32, HEADS)
    assert type(platform.attention_backend) is TorchAttentionBackend and platform.attention_backend.name == "torch"
    assert type(platform.layer_ops) is TorchLayerOps


def test_the_kernel_build_key_covers_every_source_file():
    """The library's cache key hashes the files it lists: a file left off would let an edited kernel
    run as its stale build."""
    on_disk = {p.name for p in cpu_kernels.SOURCE_DIR.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == set(cpu_kernels.SOURCES) | set(cpu_kernels.HEADERS)


def _layer_and_head(dtype: torch.dtype) -> nn.ModuleList:
    torch.manual_seed(0)
    layer, embedding = Linear(48, 64, bias=True), VocabEmbedding(80, 48)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_(), embedding.weight.normal_()
    return nn.ModuleList([layer, LMHead(80, 48, tied_to=embedding)]).to(dtype)


@pytest.mark.parametrize("dtype,float32_copy,native_bf16,expected,packed_dtype", [
    (torch.float32, True, False, "2 matmul weights prepacked, 0 with a float32 copy", torch.float32),
    pytest.param(torch.bfloat16, True, True, "2 matmul weights prepacked, 0 with a float32 copy", torch.bfloat16,
                 marks=needs_bf16_packing),
    (torch.bfloat16, True, False, "0 matmul weights prepacked, 2 with a float32 copy", torch.float32),
    (torch.bfloat16, False, False, "0 matmul weights prepacked, 0 with a float32 copy", None),
    (torch.float16, True, True, "0 matmul weights prepacked, 0 with a float32 copy", None),  # no copy beside native bf16
])
def test_cpu_platform_packs_weights_by_dtype_and_cpu(dtype, float32_copy, native_bf16, expected, packed_dtype):
    platform = CpuPlatform(dtype, TorchAttentionBackend(), TorchLayerOps(), float32_copy=float32_copy,
                           native_bf16=native_bf16)
    modules = _layer_and_head(dtype)
    assert platform.process_weights_after_loading(modules) == expected
    for module in modules:
        assert (None if module.packed_weight is None else module.packed_weight.dtype) == packed_dtype


def test_cpu_platform_asks_the_cpu_for_native_bf16_when_not_told(monkeypatch):
    for has_it in (True, False):
        monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: has_it)
        platform = CpuPlatform(torch.bfloat16, TorchAttentionBackend(), TorchLayerOps(), float32_copy=True)
        assert (platform.native_bf16, platform.float32_copy) == (has_it, not has_it)


class CountingOps(LayerOps):
    """Counts each op's calls, then runs `inner`'s."""

    def __init__(self, inner: LayerOps):
        self.inner, self.calls = inner, collections.Counter()

    def rms_norm(self, *args):
        self.calls["rms_norm"] += 1
        return self.inner.rms_norm(*args)

    def add_rms_norm(self, *args):
        self.calls["add_rms_norm"] += 1
        return self.inner.add_rms_norm(*args)

    def silu_and_mul(self, *args):
        self.calls["silu_and_mul"] += 1
        return self.inner.silu_and_mul(*args)

    def rope_and_cache(self, *args):
        self.calls["rope_and_cache"] += 1
        return self.inner.rope_and_cache(*args)


def _prefill(model, platform, num_tokens: int = 7) -> torch.Tensor:
    layers = model.attention_layers()
    layout = KVCacheLayout(len(layers), layers[0].num_kv_heads, layers[0].head_dim, 4, platform.dtype)
    for layer, cache in zip(layers, allocate_kv_caches(layout, 4, platform.attention_backend, platform.device)):
        layer.kv_cache = cache
    common = CommonAttentionMetadata(torch.tensor([0, num_tokens]), torch.tensor([num_tokens]),
                                     torch.arange(num_tokens) + 4, torch.tensor([[1, 2]]), 4, [num_tokens],
                                     [num_tokens])
    with torch.inference_mode():
        return model(torch.arange(3, 3 + num_tokens), torch.arange(num_tokens),
                     platform.attention_backend.build_metadata(common))


def test_a_model_built_on_the_cpu_platform_calls_its_ops_in_every_layer(tiny_llama_dir, kernel_cache):
    """2 layers: one plain norm, then a residual add + norm after each attention and MLP but the
    last, and the final one; one SiLU-and-mul and one RoPE + cache write per layer."""
    hf_config = load_config(tiny_llama_dir)
    base = build_platform(WorkerConfig(cache_dir=str(kernel_cache)), torch.device("cpu"), torch.float32,
                          AttentionHeads.from_hf_config(hf_config))
    ops = CountingOps(base.layer_ops)
    platform = CpuPlatform(torch.float32, base.attention_backend, ops, float32_copy=False)
    model = load_model(tiny_llama_dir, platform, config=hf_config)
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, Attention)):
            assert module.ops is ops
        if isinstance(module, Attention):
            assert module.backend is base.attention_backend
    hidden = _prefill(model, platform)
    assert ops.calls == {"rms_norm": 1, "add_rms_norm": 4, "silu_and_mul": 2, "rope_and_cache": 2}
    reference_platform = CpuPlatform(torch.float32, TorchAttentionBackend(), TorchLayerOps(), float32_copy=False)
    reference = load_model(tiny_llama_dir, reference_platform, config=hf_config)
    torch.testing.assert_close(hidden, _prefill(reference, reference_platform), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("flag,expected_backend,expected_ops", [("auto", "cpu", CpuLayerOps),
                                                                 ("torch", "torch", TorchLayerOps)])
def test_worker_builds_its_platform_once_and_hands_it_on(tiny_llama_dir, kernel_cache, flag, expected_backend,
                                                         expected_ops):
    worker = Worker(WorkerConfig(model=str(tiny_llama_dir), dtype="float32", cache_dir=str(kernel_cache),
                                 attention_backend=flag, kv_cache_bytes=2**20))
    worker.load_model()
    platform, runner = worker.platform, worker.model_runner
    assert type(platform.layer_ops) is expected_ops
    assert runner.attn_backend is platform.attention_backend and runner.sampler is platform.sampler
    assert all(layer.backend is platform.attention_backend for layer in runner.model.attention_layers())
    spec = worker.describe_kv_cache()
    # 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB a block: 128 in 1 MiB
    assert (spec.attention_backend, spec.block_bytes, spec.num_blocks) == (expected_backend, 8192, 128)


def test_cuda_platform_picks_its_backend_and_sampler_by_flag_and_head_size(monkeypatch):
    """Chosen without a GPU: the launcher loads CuPy only on its first launch."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    cuda = torch.device("cuda")
    cases = [("auto", 64, CupyAttentionBackend, CudaSampler), ("auto", 80, TorchAttentionBackend, CudaSampler),
             ("torch", 64, TorchAttentionBackend, TorchSampler)]
    for flag, head_dim, backend_cls, sampler_cls in cases:
        config = WorkerConfig(attention_backend=flag, gpu_memory_utilization=0.5)
        platform = build_platform(config, cuda, torch.bfloat16, AttentionHeads(8, 2, head_dim))
        assert isinstance(platform, CudaPlatform) and platform.device == cuda
        assert type(platform.attention_backend) is backend_cls and type(platform.sampler) is sampler_cls
        assert type(platform.layer_ops) is TorchLayerOps and platform.gpu_memory_utilization == 0.5
        if backend_cls is CupyAttentionBackend:
            assert platform.attention_backend.num_sms == 132
            assert platform.sampler.launcher is platform.attention_backend.launcher  # one launcher
    modules = _layer_and_head(torch.float32)
    assert platform.process_weights_after_loading(modules) == "weights as loaded"
    assert all(m.packed_weight is None for m in modules)


def test_importing_the_cuda_platform_imports_no_cupy():
    code = "import sys, services.worker.platforms.cuda; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
