"""bfloat16 matmuls of a few dozen to a few hundred rows on the AMX tile unit (csrc/gemm_amx_bf16.c).

oneDNN multiplies on the same unit, but at a decode batch's row counts its prepacked GEMM runs far
below the memory bandwidth: SmolLM2-135M's 30 layers' matmuls at 48 rows took 16.1 ms on oneDNN
against 11.4 ms on this kernel on a 2-core Sapphire Rapids VM (docs/benchmarks.md, "AMX"). Each
weight the kernel takes is repacked once into its B-tile layout (`AmxWeight`), beside oneDNN's copy,
and used from just above the column tiles' rows (tile_rows.py) up to the rows `AmxRowSelector`
measured for its shape; oneDNN keeps the larger matmuls (prefill chunks). Where the CPU or the
library lacks AMX-BF16, or the kernel never wins for a shape, nothing changes.

Weight-only int8 (`--quantization int8`) with bfloat16 activations has the same kernel on int8
panels (`AmxInt8Weight`), widened to bfloat16 in the kernel: half the bytes to stream. Its rows
start where it first beats the int8 GEMV and end where the int8 weight's other path (int8pack_mm or
the widened oneDNN GEMM) wins, both timed per shape (`AmxRowSelector.int8_rows`).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from services.worker.layers.kernel_timing import ThresholdStore, best_time, first_win, last_win
from services.worker.layers.linear import LinearBase, pack_weight, packed_linear
from services.worker.layers.weight_memory import WeightAllocator, plain_weight_memory

if TYPE_CHECKING:
    from services.worker.layers.int8_linear import Int8Weight

logger = logging.getLogger(__name__)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
K_MULTIPLE = 32  # the kernel reads x in place as tiles of 32 input positions
ROW_GRID = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # row counts timed against oneDNN
# int8 weights: from a few rows, where the kernel takes over from the int8 GEMV, to prefill chunks
INT8_ROW_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True)
class AmxWeight:
    """A bfloat16 weight [n_size, k_size] in gemm_amx_bf16.c's B-tile panels."""

    data: torch.Tensor
    n_size: int
    k_size: int
    max_rows: int  # `LinearBase.forward` takes the kernel up to this many rows


@dataclass(frozen=True)
class AmxInt8Weight:
    """An int8 weight [n_size, k_size] in the same panels, and its float32 scale per output column."""

    data: torch.Tensor
    scales: torch.Tensor
    n_size: int
    k_size: int
    max_rows: int  # `Int8Weight.linear` takes the kernel above its GEMV's rows up to this many


class AmxGemm:
    """y = x W^T (+ b) for bfloat16 x [M, K] and a packed W; y [M, N] bfloat16, summed in float32."""

    def __init__(self, library: ctypes.CDLL):
        self._gemm, self._pack, self._numel = library.gemm_amx_bf16, library.gemm_amx_pack, library.gemm_amx_numel
        self._gemm.argtypes, self._gemm.restype = [_P] * 4 + [_I64] * 3, ctypes.c_int
        self._pack.argtypes, self._pack.restype = [_P, _P, _I64, _I64], None
        self._numel.argtypes, self._numel.restype = [_I64, _I64], _I64
        self._gemm_int8, self._pack_int8 = library.gemm_amx_int8w, library.gemm_amx_int8w_pack
        self._gemm_int8.argtypes, self._gemm_int8.restype = [_P] * 5 + [_I64] * 3, ctypes.c_int
        self._pack_int8.argtypes, self._pack_int8.restype = [_P, _P, _I64, _I64], None
        # Built for AMX-BF16 and the tile state granted by the kernel (arch_prctl).
        self.available = bool(library.gemm_amx_available())

    @staticmethod
    def supports_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        plain = weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
        return plain and weight.is_contiguous() and weight.numel() > 0 and weight.shape[1] % K_MULTIPLE == 0 and (
            bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))

    def pack(self, weight: torch.Tensor, max_rows: int,
             allocate: WeightAllocator = plain_weight_memory) -> AmxWeight:
        """`allocate`: where the packed copy lives (weight_memory.py: huge pages for the kept copies)."""
        n_size, k_size = weight.shape
        data = allocate(self._numel(n_size, k_size), torch.bfloat16)
        self._pack(weight.data_ptr(), data.data_ptr(), n_size, k_size)
        return AmxWeight(data, n_size, k_size, max_rows)

    @staticmethod
    def supports_int8(qweight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        plain = qweight.device.type == "cpu" and qweight.dtype == torch.int8 and qweight.dim() == 2
        return plain and qweight.is_contiguous() and qweight.numel() > 0 and qweight.shape[1] % K_MULTIPLE == 0 and (
            bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))

    def pack_int8(self, qweight: torch.Tensor, scales: torch.Tensor, max_rows: int,
                  allocate: WeightAllocator = plain_weight_memory) -> AmxInt8Weight:
        n_size, k_size = qweight.shape
        data = allocate(self._numel(n_size, k_size), torch.int8)
        self._pack_int8(qweight.data_ptr(), data.data_ptr(), n_size, k_size)
        return AmxInt8Weight(data, scales.float().contiguous(), n_size, k_size, max_rows)

    def __call__(self, x: torch.Tensor, weight: AmxWeight | AmxInt8Weight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.k_size:
            raise ValueError(f"AMX GEMM: x {x.dtype} {tuple(x.shape)} against a packed weight "
                             f"[{weight.n_size}, {weight.k_size}]")
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.n_size, dtype=torch.bfloat16)
        bias_ptr = None if bias is None else bias.data_ptr()
        if isinstance(weight, AmxInt8Weight):
            status = self._gemm_int8(x.data_ptr(), weight.data.data_ptr(), weight.scales.data_ptr(), bias_ptr,
                                     out.data_ptr(), x.shape[0], weight.n_size, weight.k_size)
        else:
            status = self._gemm(x.data_ptr(), weight.data.data_ptr(), bias_ptr, out.data_ptr(), x.shape[0],
                                weight.n_size, weight.k_size)
        if status:
            raise RuntimeError("AMX GEMM: the tile unit was refused or memory ran out")
        return out


class AmxRowSelector:
    """Each weight shape's row limit on the AMX kernel: timed once against oneDNN's prepacked GEMM at
    `ROW_GRID`, the last count before oneDNN first won twice in a row (0: the kernel never won, and
    the shape stays on oneDNN). Stored per machine in `cache_path` (None: in memory), as the column
    tiles' limits are, so restarts keep them and their greedy output."""

    def __init__(self, num_repeats: int = 3, cache_path: Path | None = None):
        self.num_repeats = num_repeats
        self.limits: dict[tuple[int, int], int] = {}
        self._store = ThresholdStore(cache_path, "AMX GEMM row limits")

    def max_rows(self, weight: torch.Tensor, gemm: AmxGemm, min_rows: int) -> int:
        """`weight` [N, K] bfloat16 (plain); `min_rows`: the rows below this kernel (column tiles)."""
        key = (weight.shape[0], weight.shape[1])
        if key not in self.limits:
            self.limits[key] = self._store.get(f"bf16-amx/{key[0]}x{key[1]}",
                                               lambda: self._measure(weight, gemm, min_rows))
            logger.info("bfloat16 %dx%d: AMX GEMM up to %d rows, oneDNN above", *key, self.limits[key])
        return self.limits[key]

    def _measure(self, weight: torch.Tensor, gemm: AmxGemm, min_rows: int) -> int:
        packed, amx = pack_weight(weight), gemm.pack(weight, 0)  # copies for the timing only

        def amx_wins(num_rows: int) -> bool:
            x = torch.randn(num_rows, weight.shape[1]).to(torch.bfloat16)
            amx_s = best_time(lambda: gemm(x, amx), self.num_repeats)
            return amx_s <= best_time(lambda: packed_linear(x, packed, None), self.num_repeats)

        return last_win(tuple(r for r in ROW_GRID if r > min_rows), amx_wins, 0)[0]

    def int8_rows(self, int8: Int8Weight, gemm: AmxGemm) -> tuple[int, int]:
        """For `int8` with bfloat16 x: (the rows its GEMV keeps, the AMX kernel's limit above them).
        The kernel starts at the first count of INT8_ROW_GRID where it wins, the GEMV keeping the counts
        below; the limit is 0 where it never won."""
        name = f"int8w-amx/{int8.shape[0]}x{int8.shape[1]}"
        wins = self._int8_timing(int8, gemm)
        start = self._store.get(f"{name}/from", lambda: first_win(INT8_ROW_GRID, wins))
        if not start:
            return int8.max_gemv_rows, 0
        grid = tuple(r for r in INT8_ROW_GRID if r >= start)
        limit = self._store.get(f"{name}/to", lambda: last_win(grid, wins, start)[0])
        below = [r for r in INT8_ROW_GRID if r < start]
        gemv_rows = min(int8.max_gemv_rows, below[-1] if below else 0) if int8.gemv is not None else 0
        logger.info("int8 %dx%d bfloat16: int8 GEMV up to %d rows, AMX GEMM up to %d", *int8.shape, gemv_rows, limit)
        return gemv_rows, limit

    def _int8_timing(self, int8: Int8Weight, gemm: AmxGemm) -> Callable[[int], bool]:
        """Whether the kernel beats the weight's path at a row count (its GEMV, or the path above it)."""
        packed: list[AmxInt8Weight] = []  # a copy for the timing only, packed when first timed

        def amx_wins(num_rows: int) -> bool:
            if not packed:
                packed.append(gemm.pack_int8(int8.qweight, int8.scales, 0))
            x = torch.randn(num_rows, int8.shape[1]).to(torch.bfloat16)
            amx_s = best_time(lambda: gemm(x, packed[0]), self.num_repeats)
            return amx_s <= best_time(lambda: int8.linear(x), self.num_repeats)

        return amx_wins


def use_amx_int8(model: nn.Module, gemm: AmxGemm, selector: AmxRowSelector,
                 allocate: WeightAllocator = plain_weight_memory) -> int:
    """After `quantize_model` (weight-only int8, bfloat16 activations): gives every int8 weight the
    kernel supports and wins on its AMX panels, above its GEMV's (possibly lowered) rows; returns how many."""
    num_packed = 0
    for layer in model.modules():
        int8 = layer.int8_weight if isinstance(layer, LinearBase) else None
        if int8 is None or int8.w8a8 is not None or not AmxGemm.supports_int8(int8.qweight, layer.bias):
            continue
        num_packed += use_amx_int8_weight(int8, gemm, selector, allocate)
    return num_packed


def use_amx_int8_weight(int8: Int8Weight, gemm: AmxGemm, selector: AmxRowSelector,
                        allocate: WeightAllocator = plain_weight_memory) -> bool:
    """Packs one weight-only int8 weight (without bias) into AMX panels where the kernel wins above
    its GEMV's (possibly lowered) rows; returns whether it did."""
    gemv_rows, max_rows = selector.int8_rows(int8, gemm)
    if max_rows <= gemv_rows:
        return False
    int8.max_gemv_rows = gemv_rows
    int8.amx_gemm = gemm
    int8.amx_weight = gemm.pack_int8(int8.qweight, int8.scales, max_rows, allocate)
    return True


def use_amx_gemm(model: nn.Module, gemm: AmxGemm, selector: AmxRowSelector,
                 allocate: WeightAllocator = plain_weight_memory) -> int:
    """Packs every bfloat16 matmul weight the kernel supports and beats oneDNN on, taken above the
    layer's column-tile rows up to its measured limit, into memory from `allocate`; returns how many.
    Run before prepacking (it reads the plain weight)."""
    num_packed = 0
    for layer in model.modules():
        if not isinstance(layer, LinearBase) or not AmxGemm.supports_weight(layer.weight, layer.bias):
            continue
        min_rows = layer.gemv_tiles.max_rows if layer.gemv_tiles is not None else 0
        max_rows = selector.max_rows(layer.weight, gemm, min_rows)
        if max_rows > min_rows:
            layer.amx_gemm, layer.amx_weight = gemm, gemm.pack(layer.weight, max_rows, allocate)
            num_packed += 1
    return num_packed
