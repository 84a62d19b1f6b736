"""bfloat16 matmuls of a few dozen to a few hundred rows on the AMX tile unit (csrc/gemm_amx_bf16.c).

oneDNN multiplies on the same unit, but at a decode batch's row counts its prepacked GEMM runs far
below the memory bandwidth: SmolLM2-135M's 30 layers' matmuls at 48 rows took 16.1 ms on oneDNN
against 11.4 ms on this kernel on a 2-core Sapphire Rapids VM (docs/benchmarks.md, "AMX"). Each
weight the kernel takes is repacked once into its B-tile layout (`AmxWeight`), beside oneDNN's copy,
and used from just above the column tiles' rows (tile_rows.py) up to the rows `AmxRowSelector`
measured for its shape; oneDNN keeps the larger matmuls (prefill chunks). Where the CPU or the
library lacks AMX-BF16, or the kernel never wins for a shape, nothing changes.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.worker.layers.kernel_timing import ThresholdStore, best_time, last_win
from services.worker.layers.linear import LinearBase, pack_weight, packed_linear
from services.worker.layers.weight_memory import WeightAllocator, plain_weight_memory

logger = logging.getLogger(__name__)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
K_MULTIPLE = 32  # the kernel reads x in place as tiles of 32 input positions
ROW_GRID = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # row counts timed against oneDNN


@dataclass(frozen=True)
class AmxWeight:
    """A bfloat16 weight [n_size, k_size] in gemm_amx_bf16.c's B-tile panels."""

    data: torch.Tensor
    n_size: int
    k_size: int
    max_rows: int  # `LinearBase.forward` takes the kernel up to this many rows


class AmxGemm:
    """y = x W^T (+ b) for bfloat16 x [M, K] and a packed W; y [M, N] bfloat16, summed in float32."""

    def __init__(self, library: ctypes.CDLL):
        self._gemm, self._pack, self._numel = library.gemm_amx_bf16, library.gemm_amx_pack, library.gemm_amx_numel
        self._gemm.argtypes, self._gemm.restype = [_P] * 4 + [_I64] * 3, ctypes.c_int
        self._pack.argtypes, self._pack.restype = [_P, _P, _I64, _I64], None
        self._numel.argtypes, self._numel.restype = [_I64, _I64], _I64
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

    def __call__(self, x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.k_size:
            raise ValueError(f"AMX GEMM: x {x.dtype} {tuple(x.shape)} against a packed weight "
                             f"[{weight.n_size}, {weight.k_size}]")
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.n_size, dtype=torch.bfloat16)
        if self._gemm(x.data_ptr(), weight.data.data_ptr(), None if bias is None else bias.data_ptr(),
                      out.data_ptr(), x.shape[0], weight.n_size, weight.k_size):
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
