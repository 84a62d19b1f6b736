"""The CPU platform: PyTorch with the compiled C kernels of csrc/ where they load.

With the kernels (`--attention-backend auto`, the default): decode attention on the paged-decode
kernel for the cache dtypes and head sizes it supports (else PyTorch attention), prefill attention
on the paged-prefill kernel for bfloat16 on CPUs with AVX512_BF16 (else SDPA), and residual add
+ RMSNorm, float32 SiLU-and-mul and RoPE + KV cache write as single kernel calls. Without them
(`--attention-backend torch`, or a library that did not build): PyTorch throughout. Weights are
prepacked for oneDNN (float32, and bfloat16 where the CPU has bfloat16 arithmetic), or 16-bit
weights get a float32 copy for batches; with `--quantization int8` or `w8a8` they are quantized to int8
instead (layers/int8_linear.py). Decode matmuls of a few rows take the compiled GEMVs where the
kernels load (bfloat16: layers/gemv.py; int8: layers/int8_gemv.py), unless `--cpu-gemv false`.
The KV cache gets the `--kv-cache-bytes` budget; with `--kv-cache-dtype int8` it holds int8 keys
and values with their scales (attention/cpu_int8_backend.py).
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch import nn

from services.common.model_files import default_cache_dir
from services.worker.attention.backend import AttentionBackend
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.amx_attention import use_amx_attention
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.cpu_decode_int8 import PagedDecodeInt8Kernel
from services.worker.attention.cpu_int8_backend import Int8CacheCpuBackend
from services.worker.attention.cpu_prefill import PagedPrefillKernel
from services.worker.attention.int8_kv_cache import Int8KVDequantizer, Int8KVWriter
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import (INT8_WEIGHT_QUANTIZATIONS, RunnerConfig, WorkerConfig, cpu_has_amx_bf16,
                                     cpu_has_amx_int8, cpu_has_int8_dot, cpu_has_native_bf16)
from services.worker.cpu_argmax import CpuGreedyArgmax
from services.worker.cpu_bitmask import CpuTokenBitmask
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.kv_cache import KVCacheLayout
from services.worker.layers.amx_gemm import AmxGemm, AmxRowSelector, use_amx_gemm, use_amx_int8, use_amx_int8_weight
from services.worker.layers.embedding import LMHead
from services.worker.layers.greedy_head import GreedyHeadScreen
from services.worker.layers.fused_ops import CpuLayerOps, FusedOps
from services.worker.layers.gemv import Gemv, use_gemv, use_widened_int8_tiles
from services.worker.layers.int8_gemv import Int8Gemv
from services.worker.layers.int8_linear import Int8PathSelector, Int8Weight, quantize_model, weight_only_int8
from services.worker.layers.layer_ops import LayerOps, TorchLayerOps
from services.worker.layers.linear import (MAX_GEMV_ROWS, LinearBase, add_float32_copies, can_prepack,
                                          prepack_cpu_weights)
from services.worker.layers.tile_rows import TileRowSelector
from services.worker.layers.weight_memory import (HugePageArena, WeightAllocator, plain_weight_memory,
                                                  weight_allocator)
from services.worker.layers.w8a8 import W8A8Kernels, int_mm_is_exact, resolve_group_size
from services.worker.models.decode_stack import DecodeLayersKernel
from services.worker.platforms.cpu_malloc import keep_step_memory
from services.worker.platforms.interface import AttentionHeads, Platform
from services.worker.sampler import TorchSampler

logger = logging.getLogger(__name__)

INT8_THRESHOLDS_FILE = "int8_kernel_thresholds.json"  # in the cache dir: measured once per machine
TILE_ROWS_FILE = "bf16_tile_rows.json"  # in the cache dir: measured once per machine, where the CPU has AMX
AMX_ROWS_FILE = "bf16_amx_rows.json"  # likewise, the AMX kernel's row limits


def _cache_dir(config: WorkerConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else default_cache_dir()


class CpuPlatform(Platform):
    name = "cpu"

    def __init__(self, dtype: torch.dtype, attention_backend: AttentionBackend, layer_ops: LayerOps, *,
                 float32_copy: bool, kv_cache_bytes: int = WorkerConfig.kv_cache_bytes,
                 native_bf16: bool | None = None, sampler: TorchSampler | None = None,
                 quantization: str = "none", gemv: Gemv | None = None,
                 int8_selector: Int8PathSelector | None = None, int8_gemv: Int8Gemv | None = None,
                 w8a8: W8A8Kernels | None = None, decode_layers: DecodeLayersKernel | None = None,
                 tile_rows: TileRowSelector | None = None, amx_gemm: AmxGemm | None = None,
                 amx_rows: AmxRowSelector | None = None, weight_memory: WeightAllocator = plain_weight_memory,
                 greedy_screen_library: ctypes.CDLL | None = None):
        """`float32_copy`: 16-bit weights also get a float32 packed copy for batches, unless the CPU
        multiplies bfloat16 natively. `kv_cache_bytes`: the KV cache budget (default: the flag's).
        `native_bf16`: None asks this CPU (`cpu_has_native_bf16`). `quantization`: none or int8,
        whose kernel thresholds `int8_selector` measures (or finds stored).
        `gemv`: the compiled GEMV, which bfloat16 weights then keep their plain copy for.
        `int8_gemv`: the compiled GEMV for int8 weights (a few rows, bfloat16 or float32 x).
        `w8a8`: the passes around the int8 GEMM that `--quantization w8a8` needs.
        `decode_layers`: the compiled decoder stack for few-row decode steps (models/decode_stack.py).
        `tile_rows`: each bfloat16 weight shape's row limit on the column tiles (None: the GEMV's
        `max_tile_rows` for all). `amx_gemm`: the AMX-BF16 GEMM for bfloat16 matmuls above the tiles'
        rows (None: oneDNN takes them), up to each shape's limit from `amx_rows`. `weight_memory`: where
        the column tiles' and the AMX GEMM's packed weights live (layers/weight_memory.py).
        `greedy_screen_library`: the kernels for bfloat16 LM heads' greedy screens (layers/greedy_head.py;
        None: no screen)."""
        if quantization == "w8a8" and w8a8 is None:
            raise ValueError("--quantization w8a8 needs the compiled CPU kernels, which did not build or load "
                             "here (see the log above); use --quantization int8")
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.layer_ops = layer_ops
        self.sampler = sampler or TorchSampler()
        self.kv_cache_budget_bytes = kv_cache_bytes
        self.native_bf16 = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        self.float32_copy = float32_copy and not self.native_bf16
        self.quantization = quantization
        self.int8_selector = int8_selector or Int8PathSelector()
        self.gemv = gemv
        self.int8_gemv = int8_gemv
        self.w8a8 = w8a8
        self.decode_layers = decode_layers
        self.tile_rows = tile_rows
        self.amx_gemm = amx_gemm
        self.amx_rows = amx_rows or AmxRowSelector()
        self.weight_memory = weight_memory
        self.greedy_screen_library = greedy_screen_library if dtype == torch.bfloat16 and quantization == "none" \
            else None

    @classmethod
    def from_config(cls, config: WorkerConfig, dtype: torch.dtype, heads: AttentionHeads) -> CpuPlatform:
        if not keep_step_memory():
            logger.info("malloc thresholds not set (no glibc mallopt): steps may fault their activations in again")
        kernels = None
        if config.attention_backend != "torch":
            kernels = load_cpu_kernels(Path(config.cache_dir) if config.cache_dir else None)
        backend, layer_ops = _backend_and_ops(kernels, dtype, heads, config.kv_cache_dtype,
                                              config.cpu_amx_attention)
        sampler = TorchSampler(CpuTokenBitmask(kernels), CpuGreedyArgmax(kernels)) if kernels is not None \
            else TorchSampler()
        gemv_on = kernels is not None and config.cpu_gemv
        amx_gemm = None
        if kernels is not None and config.cpu_amx_gemm and dtype == torch.bfloat16 and cpu_has_amx_bf16():
            amx_gemm = AmxGemm(kernels)
            if not amx_gemm.available:
                logger.info("AMX GEMM: the library lacks AMX-BF16 or the kernel refused the tile state; oneDNN "
                            "keeps the larger bfloat16 matmuls")
                amx_gemm = None
        w8a8 = None
        if config.quantization == "w8a8" and kernels is not None:
            if not cpu_has_int8_dot():
                # oneDNN then multiplies int8 on a generic path: exact, but a 32-row decode step of
                # SmolLM2-135M took 1,426 ms against 213 with int8 weights alone (2-core AVX2 EPYC).
                raise ValueError("--quantization w8a8 needs int8 dot products (AVX512_VNNI, AVX_VNNI or AMX-INT8), "
                                 "which this CPU lacks; use --quantization int8")
            if not int_mm_is_exact():
                raise ValueError("--quantization w8a8: torch._int_mm does not multiply int8 exactly on this CPU "
                                 "(it needs AVX512_VNNI, AVX_VNNI or AMX-INT8); use --quantization int8")
            has_tiles = config.cpu_gemm_tiles and dtype == torch.bfloat16 and W8A8Kernels(kernels).has_tiles
            amx_int8 = cpu_has_amx_int8()
            group_size = resolve_group_size(config.w8a8_group_size, has_tiles=has_tiles, measures_tile_rows=amx_int8)
            w8a8 = W8A8Kernels(kernels, config.cpu_gemm_tiles, measures_tile_rows=amx_int8, group_size=group_size)
        return cls(dtype, backend, layer_ops, kv_cache_bytes=config.kv_cache_bytes,
                   float32_copy=config.cpu_float32_copy, sampler=sampler, quantization=config.quantization,
                   gemv=Gemv(kernels, config.cpu_gemm_tiles) if gemv_on else None,
                   tile_rows=TileRowSelector(is_measured=cpu_has_amx_bf16(),
                                             cache_path=_cache_dir(config) / TILE_ROWS_FILE),
                   int8_gemv=Int8Gemv(kernels) if gemv_on else None,
                   int8_selector=Int8PathSelector(cache_path=_cache_dir(config) / INT8_THRESHOLDS_FILE), w8a8=w8a8,
                   amx_gemm=amx_gemm, amx_rows=AmxRowSelector(cache_path=_cache_dir(config) / AMX_ROWS_FILE),
                   decode_layers=DecodeLayersKernel(kernels) if gemv_on and config.cpu_fused_decode else None,
                   weight_memory=weight_allocator(config.cpu_huge_pages),
                   greedy_screen_library=kernels if config.cpu_greedy_head_screen and config.tensor_parallel_size == 1
                   else None)

    def process_weights_after_loading(self, model: nn.Module) -> str:
        if self.quantization in INT8_WEIGHT_QUANTIZATIONS:  # int8 weights are neither packed nor copied
            summary = quantize_model(model, self.dtype, self.native_bf16, self.int8_selector, self.int8_gemv,
                                     self.w8a8)
            if self.amx_gemm is not None and self.w8a8 is None and self.dtype == torch.bfloat16:
                num_amx = use_amx_int8(model, self.amx_gemm, self.amx_rows, self.weight_memory)
                if num_amx:
                    limit = _row_limits(m.int8_weight.amx_weight for m in model.modules()
                                        if isinstance(m, LinearBase) and m.int8_weight is not None)
                    summary += f", {num_amx} in int8 panels on the AMX GEMM up to {limit} rows"
            elif self.gemv is not None and self.w8a8 is None and self.dtype == torch.bfloat16:
                num_tiled = use_widened_int8_tiles(model, self.gemv, self.int8_selector, self.weight_memory)
                if num_tiled:
                    rows = sorted({m.int8_weight.max_gemv_rows for m in model.modules()
                                   if isinstance(m, LinearBase) and m.int8_weight is not None})
                    summary += f", {num_tiled} in int8 column tiles above the GEMV's {rows[0]}-{rows[-1]} rows"
            return summary
        num_packed = num_copied = num_gemv = num_amx = 0
        screens = self._add_greedy_head_screens(model)  # before packing: the screen reads the plain weight
        if self.gemv is not None and self.dtype == torch.bfloat16:  # before packing: it keeps plain weights
            num_gemv = use_gemv(model, self.gemv, self.tile_rows, self.weight_memory)
        if self.amx_gemm is not None and self.dtype == torch.bfloat16:  # after the tiles: it starts above them
            num_amx = use_amx_gemm(model, self.amx_gemm, self.amx_rows, self.weight_memory)
        if can_prepack(self.device, self.dtype, native_bf16=self.native_bf16):
            num_packed = prepack_cpu_weights(model)
        is_16bit = self.dtype in (torch.bfloat16, torch.float16)
        if self.float32_copy and is_16bit and not num_packed:  # natively packed weights need no copy
            num_copied = add_float32_copies(model)
        summary = f"{num_packed} matmul weights prepacked, {num_copied} with a float32 copy"
        if isinstance(self.weight_memory, HugePageArena) and self.weight_memory.num_bytes:
            summary += f", {self.weight_memory.num_bytes / 2**20:.0f} MiB of packed decode weights on huge pages"
        if num_amx:
            limit = _row_limits(m.amx_weight for m in model.modules() if isinstance(m, LinearBase))
            summary += f", {num_amx} on the AMX GEMM up to {limit} rows"
        summary += screens
        if num_gemv and self.gemv.has_tiles:
            limit = _row_limits(m.gemv_tiles for m in model.modules() if isinstance(m, LinearBase))
            return summary + f", {num_gemv} in column tiles up to {limit} rows"
        return summary + (f", {num_gemv} on the GEMV up to {MAX_GEMV_ROWS} rows" if num_gemv else "")

    def _add_greedy_head_screens(self, model: nn.Module) -> str:
        """Gives each bfloat16 LM head its greedy screen (an int8 copy on AMX-INT8, or on the weight-only
        int8 kernels through `_screen_int8`); says which for the load log."""
        if self.greedy_screen_library is None:
            return ""
        kernels = []
        for head in model.modules():
            if not isinstance(head, LMHead) or head.weight.dtype != torch.bfloat16 or head.bias is not None:
                continue
            head.greedy_screen = GreedyHeadScreen.build(self.greedy_screen_library, head.weight, self._screen_int8)
            kernels.append(head.greedy_screen.kernel)
        return f", LM head with an int8 greedy screen ({', '.join(kernels)})" if kernels else ""

    def _screen_int8(self, qweight: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
        int8 = weight_only_int8(qweight, scales, self.dtype, self.native_bf16, self.int8_selector, self.int8_gemv)
        if self.amx_gemm is not None and AmxGemm.supports_int8(int8.qweight, None):
            use_amx_int8_weight(int8, self.amx_gemm, self.amx_rows, self.weight_memory)
        return int8

    def kv_cache_bytes(self, model: nn.Module, layout: KVCacheLayout, config: RunnerConfig) -> int:
        return self.kv_cache_budget_bytes


def _row_limits(packed_weights) -> str:
    """The row limits of the packed weights given (None: a layer without one), for the load log."""
    rows = sorted({w.max_rows for w in packed_weights if w is not None})
    return f"{rows[0]}" if len(rows) == 1 else f"{rows[0]}-{rows[-1]} (by shape)"


def _backend_and_ops(kernels: ctypes.CDLL | None, dtype: torch.dtype, heads: AttentionHeads,
                     kv_cache_dtype: str = "auto", amx_attention: bool = True) -> tuple[AttentionBackend, LayerOps]:
    """Decode tokens on the compiled kernel where it serves the cache dtype (the model's, or int8)
    and the heads, prefills likewise on theirs (bfloat16 on CPUs with AVX512_BF16); the fused layer
    ops wherever the library loaded. An int8 cache without its kernels is refused."""
    if kernels is None:
        if kv_cache_dtype == "int8":
            raise ValueError("--kv-cache-dtype int8 needs the compiled CPU kernels, which did not build or load "
                             "here (see the log above); use --kv-cache-dtype auto")
        return TorchAttentionBackend(), TorchLayerOps()
    layer_ops = CpuLayerOps(FusedOps(kernels))
    prefill_kernel = PagedPrefillKernel(kernels)
    if not prefill_kernel.supports(dtype, heads.head_dim, heads.num_heads, heads.num_kv_heads):
        logger.info("no compiled prefill kernel for %s, %s: PyTorch SDPA for prefills", dtype, heads)
        prefill_kernel = None
    if dtype == torch.bfloat16 and use_amx_attention(kernels, amx_attention):
        logger.info("attention on the AMX tile unit where head_dim is 64 (decode: a bfloat16 cache in blocks of "
                    "16k tokens)")
    if kv_cache_dtype == "int8":
        int8_kernel = PagedDecodeInt8Kernel(kernels)
        if not int8_kernel.supports(heads.head_dim, heads.num_heads, heads.num_kv_heads):
            raise ValueError(f"--kv-cache-dtype int8: the int8 decode kernel does not serve {heads}; use "
                             "--kv-cache-dtype auto")
        return Int8CacheCpuBackend(int8_kernel, Int8KVWriter(kernels), Int8KVDequantizer(kernels),
                                   heads.num_kv_heads, heads.head_dim, prefill_kernel), layer_ops
    kernel = PagedDecodeKernel(kernels)
    if not kernel.supports(dtype, heads.head_dim, heads.num_heads, heads.num_kv_heads):
        logger.info("no compiled decode kernel for %s, %s: PyTorch decode attention", dtype, heads)
        return TorchAttentionBackend(), layer_ops
    return CpuAttentionBackend(kernel, prefill_kernel), layer_ops
