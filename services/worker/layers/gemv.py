"""The compiled GEMV (csrc/gemv.c) for decode matmuls of a few rows on a plain bfloat16 weight.

At a few rows a matmul only streams its weight, and oneDNN's GEMM runs well below the
memory bandwidth there: 30 layers' matmuls of SmolLM2-135M (212 MB of bfloat16) at one row take
about 11 ms on the GEMV against 14-17 ms on the prepacked oneDNN weight (2-core Zen 4, AVX512_BF16;
docs/benchmarks.md). The GEMV reads the checkpoint layout [out, in], so a layer that uses it keeps
its plain weight; `use_gemv` marks the layers, `LinearBase.forward` takes the GEMV for x of at
most `MAX_GEMV_ROWS` (linear.py) rows.

Where the library is built with AVX512_BF16, each such weight is instead repacked once into column
tiles (`TiledWeight`, csrc/gemm_tiles.c), which multiply without horizontal sums: as fast as the
GEMV at one row and faster than oneDNN's prepacked GEMM up to `MAX_TILE_ROWS` (linear.py) rows, so
the layers then use the tiles for every matmul of that many rows or fewer and keep no plain weight.
Where the CPU has AMX each weight shape's limit is measured instead (tile_rows.py).

Weight-only int8 weights (`--quantization int8`) take the same tiles holding int8
(`WidenedTiledWeight`), widened to bfloat16 a panel at a time inside the kernel, for the rows above
the int8 GEMV's where the CPU has AVX512_BF16 and no AMX (`use_widened_int8_tiles`).
"""
from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.layers.linear import MAX_TILE_ROWS, LinearBase
from services.worker.layers.weight_memory import WeightAllocator, plain_weight_memory

if TYPE_CHECKING:
    from services.worker.layers.int8_linear import Int8PathSelector
    from services.worker.layers.tile_rows import TileRowSelector

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_OUT_DTYPES = (torch.bfloat16, torch.float32)  # x's dtype, which the output takes


@dataclass(frozen=True)
class TiledWeight:
    """A bfloat16 weight [n_size, k_size] in gemm_tiles.c's packed column tiles."""

    data: torch.Tensor
    n_size: int
    k_size: int
    max_rows: int  # `LinearBase.forward` and the decoder stack take the tiles up to this many rows


@dataclass(frozen=True)
class WidenedTiledWeight:
    """An int8 weight [n_size, k_size] in the column tiles' layout, widened to bfloat16 at each call;
    `Int8Weight.linear` takes it for every row count above the int8 GEMV's."""

    data: torch.Tensor  # int8
    n_size: int
    k_size: int


class Gemv:
    """y = x W^T (+ b) for x [M, K] in bfloat16 or float32, W [N, K] bfloat16 contiguous, b [N]
    bfloat16 or None; y [M, N] in x's dtype, summed in float32."""

    def __init__(self, library: ctypes.CDLL, use_tiles: bool = True, max_tile_rows: int = MAX_TILE_ROWS):
        self._functions = {}
        for dtype, name in zip(_OUT_DTYPES, ("gemv_bf16", "gemv_f32")):
            function = getattr(library, name)
            function.argtypes, function.restype = [_P] * 4 + [_I64] * 3, None
            self._functions[dtype] = function
        self.has_bf16_dot = bool(library.gemv_has_bf16_dot())  # AVX512_BF16 dot products, else widened
        self.has_tiles = use_tiles and bool(library.gemm_tiles_available())  # built with AVX512_BF16
        self._tiles, self._pack = library.gemm_tiles_bf16, library.gemm_tiles_pack
        self._tiles_numel = library.gemm_tiles_numel
        self.max_tile_rows = max_tile_rows
        self._tiles.argtypes, self._tiles.restype = [_P] * 4 + [_I64] * 3, ctypes.c_int
        self._pack.argtypes, self._pack.restype = [_P, _P, _I64, _I64], None
        self._tiles_numel.argtypes, self._tiles_numel.restype = [_I64, _I64], _I64
        self._int8_tiles, self._pack_int8 = library.gemm_tiles_int8w_bf16, library.gemm_tiles_pack_int8
        self._int8_tiles.argtypes, self._int8_tiles.restype = [_P] * 5 + [_I64] * 3, ctypes.c_int
        self._pack_int8.argtypes, self._pack_int8.restype = [_P, _P, _I64, _I64], None

    @staticmethod
    def supports_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether a layer's weight (and bias) can be multiplied here; checked once, at loading."""
        plain = weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
        return plain and weight.is_contiguous() and weight.numel() > 0 and (
            bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        function = self._functions.get(x.dtype)
        if function is None or x.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"GEMV: x {x.dtype} {tuple(x.shape)} against a bfloat16 weight {tuple(weight.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        function(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                 x.shape[0], weight.shape[0], weight.shape[1])
        return out

    def pack_tiles(self, weight: torch.Tensor, max_rows: int | None = None,
                   allocate: WeightAllocator = plain_weight_memory) -> TiledWeight:
        """`weight` [N, K] (as `supports_weight` accepts it) repacked into column tiles, taken up to
        `max_rows` rows (None: `max_tile_rows`), in memory from `allocate`."""
        n_size, k_size = weight.shape
        data = allocate(self._tiles_numel(n_size, k_size), torch.bfloat16)
        self._pack(weight.data_ptr(), data.data_ptr(), n_size, k_size)
        return TiledWeight(data, n_size, k_size, self.max_tile_rows if max_rows is None else max_rows)

    def tiles(self, x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ b) for bfloat16 x [M, K] on the tiled W; y [M, N] bfloat16."""
        if not self.has_tiles or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.k_size:
            raise ValueError(f"tiled GEMM: x {x.dtype} {tuple(x.shape)} against a tiled weight "
                             f"[{weight.n_size}, {weight.k_size}]")
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.n_size, dtype=torch.bfloat16)
        self._tiles(x.data_ptr(), weight.data.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                    x.shape[0], weight.n_size, weight.k_size)
        return out

    def pack_int8_tiles(self, qweight: torch.Tensor,
                        allocate: WeightAllocator = plain_weight_memory) -> WidenedTiledWeight:
        """int8 `qweight` [N, K] repacked into the column tiles' layout, in memory from `allocate`."""
        n_size, k_size = qweight.shape
        data = allocate(self._tiles_numel(n_size, k_size), torch.int8)
        self._pack_int8(qweight.contiguous().data_ptr(), data.data_ptr(), n_size, k_size)
        return WidenedTiledWeight(data, n_size, k_size)

    def int8_tiles(self, x: torch.Tensor, weight: WidenedTiledWeight, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x (scales q)^T (+ b) for bfloat16 x [M, K], float32 scales [N], bfloat16 b; y bfloat16."""
        if not self.has_tiles or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.k_size:
            raise ValueError(f"int8 tiles: x {x.dtype} {tuple(x.shape)} against [{weight.n_size}, {weight.k_size}]")
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            bias = bias.to(torch.bfloat16).contiguous()
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.n_size, dtype=torch.bfloat16)
        if self._int8_tiles(x.data_ptr(), weight.data.data_ptr(), scales.data_ptr(),
                            None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], weight.n_size,
                            weight.k_size):
            raise MemoryError("int8 tiles: no memory for the widened panels")
        return out


def use_gemv(model: nn.Module, gemv: Gemv, tile_rows: TileRowSelector | None = None,
             allocate: WeightAllocator = plain_weight_memory) -> int:
    """Hands `gemv` to every matmul layer of `model` whose weight it supports; returns how many.
    Run before prepacking: a layer with the GEMV keeps its plain weight beside a packed one, or, where
    the library has the column tiles, the tiled weight, taken up to the rows `tile_rows` gives its
    shape (None: `gemv.max_tile_rows`); tiled weights live in memory from `allocate`."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and Gemv.supports_weight(m.weight, m.bias)]
    for layer in layers:
        layer.gemv = gemv
        if gemv.has_tiles:
            tiled = gemv.pack_tiles(layer.weight, allocate=allocate)
            if tile_rows is not None:
                tiled = dataclasses.replace(tiled, max_rows=tile_rows.max_rows(layer.weight, tiled, gemv))
            layer.gemv_tiles = tiled
    return len(layers)


def use_widened_int8_tiles(model: nn.Module, gemv: Gemv, selector: Int8PathSelector,
                           allocate: WeightAllocator = plain_weight_memory) -> int:
    """After `quantize_model` (weight-only int8, bfloat16 activations) where no AMX GEMM took the int8
    weights: each one multiplies the rows above its GEMV's (lowered to where `selector` times the GEMV
    ahead) on the column tiles holding it in int8 (one more int8 copy); returns how many. On a Zen 4
    they tied the int8 GEMV at 8 rows, beat it above, and beat int8pack_mm and the widening GEMM at
    every row count measured up to 2,048 (docs/benchmarks.md, "A Zen 4 again")."""
    if not gemv.has_tiles:
        return 0
    num_tiled = 0
    for layer in model.modules():
        int8 = layer.int8_weight if isinstance(layer, LinearBase) else None
        if int8 is None or int8.w8a8 is not None or int8.amx_weight is not None:
            continue
        if int(int8.qweight.min()) < -127:  # the byte table widens [-127, 127] (csrc/int8_bf16.h)
            continue
        int8.tiles_gemv, int8.widened_tiles = gemv, gemv.pack_int8_tiles(int8.qweight, allocate)
        if int8.gemv is not None:
            int8.max_gemv_rows = selector.max_gemv_rows_below_tiles(int8)
        num_tiled += 1
    return num_tiled
