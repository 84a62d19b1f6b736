"""The CUDA platform: attention and sampling on the NVRTC-compiled kernels of services/worker/kernels.

PyTorch attention for head sizes the kernels lack (or with `--attention-backend torch`, which also
keeps PyTorch's sampler); layer ops stay in PyTorch; weights are used as loaded; the KV cache gets
what a profiled forward at the token budget leaves of `--gpu-memory-utilization` (gpu_memory.py).
Importing this module imports no CuPy: the launcher loads it on first use.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.cupy_backend import CupyAttentionBackend
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import RunnerConfig, WorkerConfig
from services.worker.cuda_sampler import CudaSampler
from services.worker.gpu_memory import profile_kv_cache_bytes
from services.worker.kv_cache import KVCacheLayout
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.platforms.interface import AttentionHeads, Platform
from services.worker.sampler import Sampler, TorchSampler

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name = "cuda"

    def __init__(self, device: torch.device, dtype: torch.dtype, attention_backend: AttentionBackend,
                 sampler: Sampler, *, gpu_memory_utilization: float):
        self.device = device
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.layer_ops = TorchLayerOps()
        self.sampler = sampler
        self.gpu_memory_utilization = gpu_memory_utilization

    @classmethod
    def from_config(cls, config: WorkerConfig, device: torch.device, dtype: torch.dtype,
                    heads: AttentionHeads) -> CudaPlatform:
        if config.quantization != "none":
            raise ValueError(f"--quantization {config.quantization} runs on a CPU only; use --device cpu")
        if config.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} runs on a CPU only; use --device cpu")
        utilization = config.gpu_memory_utilization
        if config.attention_backend == "torch":
            return cls(device, dtype, TorchAttentionBackend(), TorchSampler(), gpu_memory_utilization=utilization)
        from services.worker.kernels.loader import CupyLauncher

        launcher = CupyLauncher()
        if not CupyAttentionBackend.supports(heads.head_dim):
            logger.warning("head_dim %d has no CUDA attention kernel: PyTorch attention on the GPU", heads.head_dim)
            return cls(device, dtype, TorchAttentionBackend(), CudaSampler(launcher),
                       gpu_memory_utilization=utilization)
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return cls(device, dtype, CupyAttentionBackend(launcher, num_sms), CudaSampler(launcher),
                   gpu_memory_utilization=utilization)

    def process_weights_after_loading(self, model: nn.Module) -> str:
        return "weights as loaded"

    def kv_cache_bytes(self, model: nn.Module, layout: KVCacheLayout, config: RunnerConfig) -> int:
        return profile_kv_cache_bytes(model, self.attention_backend, layout, config, self.gpu_memory_utilization,
                                      self.device)
