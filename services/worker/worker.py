"""The worker: owns the device, the weights, the KV cache and the model runner.

Synchronous and gRPC-free; the server calls it from one dedicated thread.
"""
from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import torch

from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from services.common.model_files import eos_token_ids, resolve_model
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import RunnerConfig, WorkerConfig, cpu_has_native_bf16, resolve_device, resolve_dtype
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.kv_cache import KVCacheLayout, num_blocks_for_budget
from services.worker.layers.fused_ops import FusedOps, use_fused_ops
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    """The flag's value, capped by the model's position limit (and a sliding window, which our
    attention does not implement, so longer sequences are refused rather than computed wrongly)."""
    limit = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, int(window))
    return min(requested, limit) if requested else limit


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_name = ""
        self.model_runner: ModelRunner | None = None
        self.kv_cache_spec: KVCacheSpec | None = None
        self.num_blocks = 0  # allocated by initialize_kv_cache

    def load_model(self) -> None:
        """Resolves (and if needed converts) the model, loads weights, sizes the KV cache."""
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        if self.config.fake_model:  # no weights: the engine-overhead benchmark's worker
            from services.worker.fake_runner import load_fake_model

            self.model_runner, self.kv_cache_spec = load_fake_model(self.config, self.dtype)
            self.model_name = self.kv_cache_spec.model_name
            logger.info("fake model: no weights, every step returns a fixed token at once")
            return
        logger.info("resolving model %s", self.config.model or "(embedded default)")
        resolved = resolve_model(self.config.model, self.config.cache_dir)
        self.model_name = self.config.served_model_name or resolved.name
        logger.info("loading weights from %s (%s, %s)", resolved.path, self.device, _dtype_name(self.dtype))
        hf_config = load_config(resolved.path)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        cpu_kernels = self._cpu_kernels()
        backend, sampler = self._attention_and_sampler(head_dim, cpu_kernels, hf_config)
        float32_copy = self.config.cpu_float32_copy and not cpu_has_native_bf16()
        model = load_model(resolved.path, self.dtype, self.device, backend, config=hf_config,
                           float32_copy=float32_copy)
        if cpu_kernels is not None:
            logger.info("fused CPU kernels in %d modules", use_fused_ops(model, FusedOps(cpu_kernels)))
        runner_config = RunnerConfig(
            block_size=self.config.block_size,
            max_model_len=resolve_max_model_len(hf_config, self.config.max_model_len),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )
        attn = model.attention_layers()
        layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, self.config.block_size, self.dtype)
        kv_cache_bytes = self.config.kv_cache_bytes
        if self.device.type == "cuda":
            from services.worker.gpu_memory import profile_kv_cache_bytes

            kv_cache_bytes = profile_kv_cache_bytes(model, backend, layout, runner_config,
                                                    self.config.gpu_memory_utilization, self.device)
        logger.info("sizing KV cache: %.0f MiB budget, %d bytes per block", kv_cache_bytes / 2**20,
                    layout.bytes_per_block)
        num_blocks = num_blocks_for_budget(
            layout, kv_cache_bytes, runner_config.max_model_len, runner_config.max_num_seqs
        )
        self.model_runner = ModelRunner(
            model, runner_config, self.device, backend, layout,
            vocab_size=hf_config.vocab_size, eos_token_ids=eos_token_ids(resolved.path), sampler=sampler,
        )
        self.kv_cache_spec = KVCacheSpec(
            block_size=self.config.block_size,
            num_blocks=num_blocks,
            block_bytes=layout.bytes_per_block,
            max_model_len=runner_config.max_model_len,
            model_name=self.model_name,
            device=str(self.device),
            dtype=_dtype_name(self.dtype),
            vocab_size=hf_config.vocab_size,
            attention_backend=backend.name,
        )
        logger.info("attention backend: %s%s", backend.name,
                    " (compiled C decode kernel)" if backend.name == "cpu" else "")

    def _cpu_kernels(self) -> ctypes.CDLL | None:
        """The compiled CPU kernels, on a CPU unless --attention-backend torch (None: PyTorch only)."""
        if self.config.attention_backend == "torch" or self.device.type == "cuda":
            return None
        return load_cpu_kernels(Path(self.config.cache_dir) if self.config.cache_dir else None)

    def _attention_and_sampler(self, head_dim: int, cpu_kernels: ctypes.CDLL | None, hf_config):
        """On a CPU, PyTorch with decode tokens on the compiled kernel (plain PyTorch without it);
        on a GPU the CUDA kernels (PyTorch attention for head sizes the kernels lack).
        None keeps the runner's default sampler."""
        if self.config.attention_backend == "torch":
            return TorchAttentionBackend(), None
        if self.device.type != "cuda":
            kernel = PagedDecodeKernel(cpu_kernels) if cpu_kernels is not None else None
            num_heads = hf_config.num_attention_heads
            num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
            # The KV cache has the model's dtype.
            if kernel is None or not kernel.supports(self.dtype, head_dim, num_heads, num_kv_heads):
                return TorchAttentionBackend(), None
            return CpuAttentionBackend(kernel), None
        from services.worker.attention.cupy_backend import CupyAttentionBackend
        from services.worker.cuda_sampler import CudaSampler
        from services.worker.kernels.loader import CupyLauncher

        launcher = CupyLauncher()
        if not CupyAttentionBackend.supports(head_dim):
            logger.warning("head_dim %d has no CUDA attention kernel: PyTorch attention on the GPU", head_dim)
            return TorchAttentionBackend(), CudaSampler(launcher)
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return CupyAttentionBackend(launcher, num_sms), CudaSampler(launcher)

    def describe_kv_cache(self) -> KVCacheSpec:
        if self.kv_cache_spec is None:
            raise RuntimeError("model not loaded yet")
        return self.kv_cache_spec

    def initialize_kv_cache(self, num_blocks: int) -> tuple[int, int]:
        """Allocates min(num_blocks, what fits) blocks (all that fit when num_blocks <= 0) and drops
        every request of an earlier scheduler connection. Returns (num_blocks, bytes)."""
        spec = self.describe_kv_cache()
        num_blocks = spec.num_blocks if num_blocks <= 0 else max(1, min(num_blocks, spec.num_blocks))
        start = time.monotonic()
        num_bytes = self.model_runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB) allocated in %.2f s",
                    num_blocks, spec.block_size, num_bytes / 2**20, time.monotonic() - start)
        return num_blocks, num_bytes

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.model_runner is None:
            raise RuntimeError("model not loaded yet")
        return self.model_runner.execute_model(scheduler_output)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
