"""W8A8 matmuls (`--quantization w8a8`): int8 weights with a scale per output channel, as
`--quantization int8` holds them, and activations quantized to int8 at each call (dynamic,
symmetric: absmax / 127, per row or per group of a row's values, below), so that a batch
multiplies on the CPU's int8 dot products (VNNI, AMX-INT8) through PyTorch's int8 GEMM,
`torch._int_mm` (oneDNN), instead of widening the weight to bfloat16.

On a 2-core Zen 4 (AVX512_VNNI) `_int_mm` ran SmolLM2-135M's layer shapes 1.6x (32 rows) to 2x
(256 rows) faster than oneDNN's prepacked bf16 GEMM (32 x 576 -> 3072: 106 against 176 us); the
quantizing and rescaling around it are one compiled pass each (csrc/w8a8.c). A few rows only
stream the weight, so without the tiles below `Int8Weight` keeps up to 16 on the weight-only int8
GEMV (activations unquantized) and hands more rows here.

Where the library is built with AVX512_VNNI, each weight is also packed once into int8 column
tiles (`Int8TiledWeight`, csrc/gemm_int8_tiles.c), faster than `_int_mm` at every row count
measured (`MAX_INT8_TILE_ROWS`); with them W8A8 takes every row count, one row too
(`quantize_model`). oneDNN's GEMM serves CPUs without AVX512_VNNI. The tiles quantize activations
in groups (`--w8a8-group-size`, 32 by default there, as OpenVINO's CPU plugin does), and with
groups hold the weights as OpenVINO compresses them, asymmetric per channel (a uint8 range and a
zero point, `Int8TiledWeight.asymmetric`): one scale per row and symmetric weights moved greedy
output about twice as far as OpenVINO's int8 pipeline (11.8 of 64 tokens kept against float32 on
32 chat prompts, OpenVINO 20.9), groups of 32 with symmetric weights 17.8, with asymmetric ones
22.0, for 1.2-1.4x the per-row matmul time from 8 rows. With one scale per row (group size 0) the
tiles hold the symmetric weights and give `_int_mm`'s int32 sums, scaled back by the same row
pass, so bit-identical; then, with AMX-INT8, where oneDNN multiplies on the tile unit and may win,
each weight shape's row limit on the tiles is measured at start-up
(`Int8PathSelector.max_int8_tile_rows`, int8_linear.py), the products the same either side of it.
Groups have no oneDNN counterpart, so they take the tiles at every row count, and auto keeps one
scale per row where the tiles are missing or AMX-INT8 is there (`resolve_group_size`).

`_int_mm` is only exact where oneDNN multiplies int8 without 16-bit intermediates: without VNNI
(AVX2's VPMADDUBSW saturates pairs of products) its sums came out wrong for full-range int8, so the
worker checks it once on extreme values (`int_mm_is_exact`) and refuses the mode where it fails.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from services.worker.layers.int8_kernels import quantize_asymmetric

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# Every row count: 30 layers of SmolLM2-135M's matmuls, weights from memory,
# on a 2-core Zen 5 (AVX512_VNNI), tiles against oneDNN's int8 GEMM with its passes: 8 rows 3.4 /
# 9.1 ms, 40 rows 7.9 / 14.5, 128 rows 19.4 / 24.7, 512 rows 67.9 / 73.9, 2,048 rows 287 / 300
# (docs/benchmarks.md, "W8A8 column tiles").
MAX_INT8_TILE_ROWS = 2**31 - 1
# `--w8a8-group-size -1` (auto) where the tiles take every matmul: OpenVINO's CPU plugin quantizes
# activations in groups of 32 too; 64 kept 15.9 tokens against 32's 17.8 for 0-11% less matmul
# time (docs/benchmarks.md, "W8A8 activations in groups of 32").
DEFAULT_W8A8_GROUP_SIZE = 32


def resolve_group_size(requested: int, *, has_tiles: bool, measures_tile_rows: bool) -> int:
    """The activation group size W8A8 runs with for `--w8a8-group-size requested`: groups need the
    int8 tiles, which oneDNN's GEMM (per row) cannot stand in for. Auto keeps rows where the tiles
    are missing or, with AMX-INT8, give way to oneDNN for large matmuls; an explicit size there is
    refused."""
    if requested == -1:
        return DEFAULT_W8A8_GROUP_SIZE if has_tiles and not measures_tile_rows else 0
    if requested > 0 and not has_tiles:
        raise ValueError(f"--w8a8-group-size {requested} needs W8A8's int8 column tiles (AVX512_VNNI, "
                         "--dtype bfloat16, --cpu-gemm-tiles), which this worker lacks; use --w8a8-group-size 0")
    return requested


@dataclass(frozen=True)
class Int8TiledWeight:
    """A weight [n_size, k_size] in gemm_int8_tiles.c's packed column tiles: W = scales_n (u - z_n)
    for uint8 u and an int32 zero point z_n per column, held in `data` after the tiles."""

    data: torch.Tensor  # int8 bytes
    scales: torch.Tensor  # float32 [n_size]
    n_size: int
    k_size: int
    max_rows: int  # `Int8Weight.linear` and the decoder stack take the tiles up to this many rows
    asymmetric: bool  # zero points from each channel's range, rather than symmetric int8's 128


class W8A8Kernels:
    """The compiled quantize / rescale passes around `torch._int_mm`; `linear` is the whole matmul."""

    DTYPES = (torch.bfloat16, torch.float32)  # activations', which the output takes

    def __init__(self, library: ctypes.CDLL, use_tiles: bool = True, measures_tile_rows: bool = False,
                 group_size: int = 0):
        self._quantize, self._dequantize = {}, {}
        for dtype, suffix in zip(self.DTYPES, ("bf16", "f32")):
            quantize = getattr(library, f"quantize_rows_int8_{suffix}")
            quantize.argtypes, quantize.restype = [_P, _I64, _P, _P, _I64, _I64], ctypes.c_int
            dequantize = getattr(library, f"dequantize_int32_{suffix}")
            dequantize.argtypes, dequantize.restype = [_P] * 5 + [_I64, _I64], ctypes.c_int
            self._quantize[dtype], self._dequantize[dtype] = quantize, dequantize
        self.has_tiles = use_tiles and bool(library.int8_tiles_available())  # AVX512_VNNI
        # AMX-INT8: each weight shape's rows on the tiles are timed against oneDNN's int8 GEMM.
        self.measures_tile_rows = measures_tile_rows and group_size == 0
        # The tiles quantize activations in groups of this many values (0: per row, as oneDNN's path).
        self.group_size = group_size
        self._tiles, self._pack, self._nbytes = library.int8_tiles_bf16, library.int8_tiles_pack, library.int8_tiles_nbytes
        self._tiles.argtypes, self._tiles.restype = [_P] * 5 + [_I64] * 4, ctypes.c_int
        self._pack.argtypes, self._pack.restype = [_P, _P, _P, _I64, _I64], None
        self._nbytes.argtypes, self._nbytes.restype = [_I64, _I64], _I64

    def pack_tiles(self, qweight: torch.Tensor, scales: torch.Tensor,
                   max_rows: int = MAX_INT8_TILE_ROWS) -> Int8TiledWeight:
        """Symmetric int8 qweight [N, K] with float32 scales [N], repacked into column tiles (after
        `has_tiles`), taken up to `max_rows` rows."""
        u = (qweight.to(torch.int16) + 128).to(torch.uint8).contiguous()
        zero_points = torch.full((qweight.shape[0],), 128, dtype=torch.int32)
        return self._packed(u, zero_points, scales, max_rows, asymmetric=False)

    def pack_asymmetric(self, weight: torch.Tensor, max_rows: int = MAX_INT8_TILE_ROWS) -> Int8TiledWeight:
        """A float weight [N, K] quantized per channel by `quantize_asymmetric`, into column tiles."""
        u, zero_points, scales = quantize_asymmetric(weight)
        return self._packed(u, zero_points, scales, max_rows, asymmetric=True)

    def _packed(self, u: torch.Tensor, zero_points: torch.Tensor, scales: torch.Tensor, max_rows: int,
                asymmetric: bool) -> Int8TiledWeight:
        n_size, k_size = u.shape
        data = torch.empty(self._nbytes(n_size, k_size), dtype=torch.int8)
        self._pack(u.data_ptr(), zero_points.data_ptr(), data.data_ptr(), n_size, k_size)
        return Int8TiledWeight(data, scales.float().contiguous(), n_size, k_size, max_rows, asymmetric)

    def tiles(self, x: torch.Tensor, weight: Int8TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bfloat16 times the tiled weight (+ bias), bfloat16; with one activation scale per
        row and symmetric weights `linear`'s result, bit for bit."""
        if not self.has_tiles or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.k_size:
            raise ValueError(f"int8 tiles: x {x.dtype} {tuple(x.shape)} against [{weight.n_size}, {weight.k_size}]")
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            bias = bias.to(torch.bfloat16).contiguous()
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.n_size, dtype=torch.bfloat16)
        status = self._tiles(x.data_ptr(), weight.data.data_ptr(), weight.scales.data_ptr(),
                             None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], weight.n_size,
                             weight.k_size, self.group_size)
        if status:
            raise MemoryError("int8 tiles: no memory for the quantized rows")
        return out

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (int8 [M, K], float32 scales [M]), q = rint(x * 127 / amax) per row."""
        function = self._quantize.get(x.dtype)
        if function is None or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"W8A8: cannot quantize {x.dtype} {tuple(x.shape)} rows")
        q = torch.empty(x.shape, dtype=torch.int8)
        scales = torch.empty(x.shape[0], dtype=torch.float32)
        function(x.data_ptr(), x.stride(0), q.data_ptr(), scales.data_ptr(), x.shape[0], x.shape[1])
        return q, scales

    def dequantize(self, acc: torch.Tensor, x_scales: torch.Tensor, w_scales: torch.Tensor,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """acc [M, N] int32 * (x_scales[m] * w_scales[n]) (+ bias) in float32, rounded once to dtype."""
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            bias = bias.to(dtype).contiguous()
        out = torch.empty(acc.shape, dtype=dtype)
        self._dequantize[dtype](acc.data_ptr(), x_scales.data_ptr(), w_scales.data_ptr(),
                                bias.data_ptr() if bias is not None else None, out.data_ptr(), *acc.shape)
        return out

    def linear(self, x: torch.Tensor, qweight: torch.Tensor, w_scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (s * Q)^T (+ b) in x's dtype for Q int8 [N, K] contiguous and s float32 [N]."""
        if x.dtype not in self._quantize:
            x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        xq, x_scales = self.quantize_rows(x)
        acc = torch._int_mm(xq, qweight.t())  # oneDNN reads Q's [N, K] rows as the transposed operand
        return self.dequantize(acc, x_scales, w_scales, bias, x.dtype)


def int_mm_is_exact() -> bool:
    """Whether `torch._int_mm` sums full-range int8 exactly on this CPU (and oneDNN ISA setting):
    rows of +-127 whose pairwise products overflow a 16-bit intermediate, and random values."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (17, 256), generator=generator, dtype=torch.int8)
    b = torch.randint(-127, 128, (48, 256), generator=generator, dtype=torch.int8)
    a[0], b[0], b[1] = 127, 127, -127
    try:
        got = torch._int_mm(a, b.t())
    except RuntimeError:
        return False
    return bool(torch.equal(got.long(), a.long() @ b.long().t()))
