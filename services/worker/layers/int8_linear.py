"""Weight-only int8 (`--quantization int8`): every matmul weight, the LM head included, held as int8
with a float32 scale per output channel; activations stay in the model's dtype (float32 or
bfloat16).

`Int8Weight` multiplies on the compiled int8 GEMV (int8_gemv.py) up to `MAX_INT8_GEMV_ROWS` rows
where the platform hands one over, and otherwise by one of two kernels (int8_kernels.py), chosen
per call by the row count: `aten._weight_int8pack_mm` up to `max_int8pack_rows` rows, the
chunk-widening GEMM above. That threshold is measured once per weight shape on this machine
(`Int8PathSelector`, stored in the cache dir so that restarts keep it and so their greedy output),
not fixed, because the crossing moves with the CPU: on a 2-core AVX512_BF16 EPYC (no AMX) the int8
GEMM wins up to 2-4 rows and loses 2.5-4x at 32 rows to the widening path's oneDNN bf16 GEMM, which
on an AMX CPU runs on AMX tiles and may cross sooner (docs/benchmarks.md, "Weight-only int8"). The
GEMV's row limit is a constant, so it cannot move between restarts either. Under
`--quantization w8a8` the rows the GEMV does not take multiply on `W8A8Kernels` (w8a8.py):
activations quantized to int8, the int8 GEMM of the CPU's int8 dot products; no threshold is
timed. Where W8A8 has its int8 column tiles (activations in groups of 32 there by default, and
then the tiles' own asymmetric copy of each weight the checkpoint did not give as int8), the GEMV
takes no rows at all.

With tied embeddings the LM head's int8 weight also serves the embedding lookup: its rows are
per-row quantized already (an output channel of the head is a token's row), so a lookup widens
the looked-up rows and scales them, and no float copy of the 49k x 576 table stays in memory.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.int8_gemv import MAX_INT8_GEMV_ROWS, Int8Gemv
from services.worker.layers.kernel_timing import ThresholdStore, best_time, last_win
from services.worker.layers.w8a8 import MAX_INT8_TILE_ROWS, Int8TiledWeight, W8A8Kernels
from services.worker.layers.int8_kernels import (
    dequantize_chunks_linear,
    has_int8pack_mm,
    int8pack_linear,
    quantize_per_channel,
)

if TYPE_CHECKING:
    from services.worker.layers.amx_gemm import AmxGemm, AmxInt8Weight
    from services.worker.layers.gemv import Gemv, WidenedTiledWeight

logger = logging.getLogger(__name__)

ROW_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # row counts timed at start-up
GEMV_ROW_GRID = (32, 64, 128, 256)  # past MAX_INT8_GEMV_ROWS, where the GEMV is timed against the other path
NO_LIMIT = 2**31  # int8pack_mm at every row count


class Int8Weight:
    """An int8 weight [out, in] with float32 per-channel scales, the compiled GEMV it multiplies a
    few rows on (`use_gemv`), and the row count up to which it multiplies on
    `aten._weight_int8pack_mm`."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, *, native_bf16: bool,
                 max_int8pack_rows: int = 0):
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != (qweight.shape[0],):
            raise ValueError(f"expected int8 [out, in] and [out] scales, got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {tuple(scales.shape)}")
        self.qweight = qweight.contiguous()
        self.scales = scales.float().contiguous()
        self.native_bf16 = native_bf16
        self.max_int8pack_rows = max_int8pack_rows if supports_int8pack(self.qweight) else 0
        self._scales_by_dtype = {torch.float32: self.scales}
        self.gemv: Int8Gemv | None = None
        self.max_gemv_rows = MAX_INT8_GEMV_ROWS  # raised where the selector measured the GEMV faster
        self.w8a8: W8A8Kernels | None = None  # set: rows off the GEMV quantize their activations
        self.tiles: Int8TiledWeight | None = None  # W8A8's column tiles, for the rows the GEMV does not take
        # Weight-only int8, bfloat16 x: the AMX GEMM and this weight in its panels, above the GEMV's rows
        self.amx_gemm: AmxGemm | None = None
        self.amx_weight: AmxInt8Weight | None = None
        # Weight-only int8, bfloat16 x, no AMX: the column tiles holding this weight, above the GEMV's rows
        self.tiles_gemv: Gemv | None = None
        self.widened_tiles: WidenedTiledWeight | None = None

    def use_gemv(self, gemv: Int8Gemv) -> bool:
        """Multiplies x of up to MAX_INT8_GEMV_ROWS rows on `gemv` from now on, where it supports
        this weight; returns whether it does."""
        if gemv.supports_weight(self.qweight, self.scales):
            self.gemv = gemv
        return self.gemv is gemv

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._scales_by_dtype.values()) + self.qweight.numel()

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The widening path's GEMM dtype: bfloat16 where the CPU has bf16 arithmetic, else float32
        (an emulated bfloat16 GEMM is several times slower than float32)."""
        return dtype if dtype == torch.float32 or (dtype == torch.bfloat16 and self.native_bf16) else torch.float32

    def scales_in(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scales_by_dtype:  # int8pack_mm takes scales in the activations' dtype
            self._scales_by_dtype[dtype] = self.scales.to(dtype)
        return self._scales_by_dtype[dtype]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, use_int8pack: bool | None = None) -> torch.Tensor:
        """x W^T (+ b) in x's dtype; `use_int8pack` None: by the row count (the GEMV first)."""
        if use_int8pack is None:
            if (self.gemv is not None and x.shape[0] <= self.max_gemv_rows and x.dim() == 2
                    and x.dtype in Int8Gemv.DTYPES):
                return self.gemv(x, self.qweight, self.scales, bias)
            if (self.amx_weight is not None and x.shape[0] <= self.amx_weight.max_rows and x.dim() == 2
                    and x.dtype == torch.bfloat16):
                return self.amx_gemm(x, self.amx_weight, bias)
            if self.widened_tiles is not None and x.dtype == torch.bfloat16:
                out = self.tiles_gemv.int8_tiles(x.reshape(-1, x.shape[-1]), self.widened_tiles, self.scales, bias)
                return out.reshape(*x.shape[:-1], self.shape[0])
            if self.tiles is not None and x.dtype == torch.bfloat16:
                rows = x.reshape(-1, x.shape[-1])
                if rows.shape[0] <= self.tiles.max_rows:
                    out = self.w8a8.tiles(rows, self.tiles, bias)
                    return out.reshape(*x.shape[:-1], self.shape[0])
            if self.w8a8 is not None:
                return self._w8a8_linear(x, bias)
            use_int8pack = x.shape[0] <= self.max_int8pack_rows
        if use_int8pack:
            out = int8pack_linear(x, self.qweight, self.scales_in(x.dtype))
        else:
            compute = self.compute_dtype(x.dtype)
            out = dequantize_chunks_linear(x, self.qweight, self.scales_in(compute), compute)
        return out if bias is None else out + bias

    def _w8a8_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.w8a8.linear(rows, self.qweight, self.scales, bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    def embedding(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows of `input_ids`, dequantized into `dtype`."""
        rows = F.embedding(input_ids, self.qweight).float()
        return (rows * self.scales[input_ids].unsqueeze(-1)).to(dtype)


def supports_int8pack(qweight: torch.Tensor) -> bool:
    # torch 2.13's int8pack_mm gives NaN or wrong sums for an input size not a multiple of 16
    # (8, 24, 40 measured) and crashes for some (33, 34, 36): such weights widen at every row count.
    return has_int8pack_mm() and qweight.shape[1] % 16 == 0


class Int8PathSelector:
    """Times both kernels once per (shape, dtype) at the row counts of ROW_GRID and keeps, as the
    threshold, the last row count before the widening path first wins twice in a row (so one noisy
    sample does not decide it, and large row counts of a slow path are not timed at all).

    The two kernels round differently, so a threshold that moved between restarts would change
    greedy output: with `cache_path` the thresholds are stored per machine (CPU capability, thread
    count, torch version) and a restart reuses them instead of timing again."""

    def __init__(self, num_repeats: int = 3, cache_path: Path | None = None):
        self.num_repeats = num_repeats
        self.cache_path = cache_path
        # (out, in, activations' dtype, widening GEMM's dtype) -> threshold
        self.thresholds: dict[tuple[int, int, torch.dtype, torch.dtype], int] = {}
        self._store = ThresholdStore(cache_path, "int8 thresholds")  # read on first use

    def max_int8pack_rows(self, weight: Int8Weight, dtype: torch.dtype) -> int:
        if not supports_int8pack(weight.qweight):
            return 0
        key = (*weight.shape, dtype, weight.compute_dtype(dtype))
        if key not in self.thresholds:
            self._find(key, lambda: self._measure(weight, dtype))
            logger.info("int8 %dx%d %s: int8pack_mm up to %s rows, widened bf16/float32 GEMM above", key[0],
                        key[1], str(dtype).removeprefix("torch."),
                        "any" if self.thresholds[key] == NO_LIMIT else self.thresholds[key])
        return self.thresholds[key]

    def max_gemv_rows(self, weight: Int8Weight, dtype: torch.dtype) -> int:
        """Up to how many rows `weight` (on the GEMV, its int8pack threshold set) multiplies on the
        GEMV: MAX_INT8_GEMV_ROWS, or the last count of GEMV_ROW_GRID before its other path won twice
        in a row. On an AVX2-only CPU the widening GEMM ran SmolLM2's 32-row decode step at 213 ms
        against 48 ms for 16 rows on the GEMV; on AVX-512 the GEMV's lead was 1.2x at 32 rows."""
        key = (*weight.shape, dtype, weight.compute_dtype(dtype), "gemv")
        if key not in self.thresholds:
            self._find(key, lambda: self._measure_gemv(weight, dtype))
            logger.info("int8 %dx%d %s: GEMV up to %d rows", key[0], key[1], str(dtype).removeprefix("torch."),
                        self.thresholds[key])
        return self.thresholds[key]

    def max_gemv_rows_below_tiles(self, weight: Int8Weight) -> int:
        """Up to how many bfloat16 rows `weight` stays on its GEMV once the column tiles holding it in
        int8 (`widened_tiles`) take the rows above: the last count of ROW_GRID before the tiles won
        twice in a row, at most the GEMV's limit against the other paths."""
        key = (*weight.shape, torch.bfloat16, "gemv-below-int8-tiles")
        if key not in self.thresholds:
            self._find(key, lambda: self._measure_gemv_below_tiles(weight))
            logger.info("int8 %dx%d bfloat16: GEMV up to %d rows, int8 column tiles above", key[0], key[1],
                        self.thresholds[key])
        return min(self.thresholds[key], weight.max_gemv_rows)

    def max_int8_tile_rows(self, weight: Int8Weight, tiles: Int8TiledWeight) -> int:
        """Up to how many bfloat16 rows W8A8 multiplies `weight` on its int8 column tiles rather
        than oneDNN's int8 GEMM (both give the same products): timed once per shape where AMX-INT8
        gives oneDNN the tile unit. 0 where the GEMM won from one row (the weight then keeps the
        weight-only GEMV's rows), MAX_INT8_TILE_ROWS where it never won."""
        key = (*weight.shape, torch.bfloat16, "int8-tiles")
        if key not in self.thresholds:
            self._find(key, lambda: self._measure_int8_tiles(weight, tiles))
            rows = self.thresholds[key]
            logger.info("int8 %dx%d W8A8: int8 column tiles %s, oneDNN's int8 GEMM above", key[0], key[1],
                        "at every row count" if rows == MAX_INT8_TILE_ROWS else f"up to {rows} rows")
        return self.thresholds[key]

    def _find(self, key: tuple, measure) -> None:
        dtypes = "/".join(str(d).removeprefix("torch.") for d in key[2:])
        self.thresholds[key] = self._store.get(f"{key[0]}x{key[1]}/{dtypes}", measure)

    def _measure(self, weight: Int8Weight, dtype: torch.dtype) -> int:
        def int8pack_wins(num_rows: int) -> bool:
            x = torch.randn(num_rows, weight.shape[1]).to(dtype)
            int8pack_s = self._best_time(lambda: weight.linear(x, use_int8pack=True))
            return int8pack_s <= self._best_time(lambda: weight.linear(x, use_int8pack=False))

        threshold, never_lost = last_win(ROW_GRID, int8pack_wins, 0)
        return NO_LIMIT if never_lost else threshold

    def _measure_gemv(self, weight: Int8Weight, dtype: torch.dtype) -> int:
        def gemv_wins(num_rows: int) -> bool:
            x = torch.randn(num_rows, weight.shape[1]).to(dtype)
            use_int8pack = num_rows <= weight.max_int8pack_rows  # the path these rows take off the GEMV
            gemv_s = self._best_time(lambda: weight.gemv(x, weight.qweight, weight.scales))
            return gemv_s <= self._best_time(lambda: weight.linear(x, use_int8pack=use_int8pack))

        return last_win(GEMV_ROW_GRID, gemv_wins, MAX_INT8_GEMV_ROWS)[0]

    def _measure_gemv_below_tiles(self, weight: Int8Weight) -> int:
        def gemv_wins(num_rows: int) -> bool:
            x = torch.randn(num_rows, weight.shape[1]).to(torch.bfloat16)
            gemv_s = self._best_time(lambda: weight.gemv(x, weight.qweight, weight.scales))
            tiles_s = self._best_time(lambda: weight.tiles_gemv.int8_tiles(x, weight.widened_tiles, weight.scales))
            return gemv_s <= tiles_s

        return last_win(ROW_GRID, gemv_wins, 0)[0]

    def _measure_int8_tiles(self, weight: Int8Weight, tiles: Int8TiledWeight) -> int:
        w8a8 = weight.w8a8

        def tiles_win(num_rows: int) -> bool:
            x = torch.randn(num_rows, weight.shape[1]).to(torch.bfloat16)
            tiles_s = self._best_time(lambda: w8a8.tiles(x, tiles))
            return tiles_s <= self._best_time(lambda: w8a8.linear(x, weight.qweight, weight.scales))

        threshold, never_lost = last_win(ROW_GRID, tiles_win, 0)
        return MAX_INT8_TILE_ROWS if never_lost else threshold

    def _best_time(self, fn) -> float:
        return best_time(fn, self.num_repeats)


def weight_only_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, native_bf16: bool,
                     selector: Int8PathSelector, gemv: Int8Gemv | None = None) -> Int8Weight:
    """An `Int8Weight` on the weight-only paths (no W8A8), as `quantize_model` sets each weight up:
    the GEMV where it supports the weight, up to its measured rows, int8pack_mm or the widening
    GEMM above."""
    int8 = Int8Weight(qweight, scales, native_bf16=native_bf16)
    int8.max_int8pack_rows = selector.max_int8pack_rows(int8, dtype)
    int8.scales_in(dtype)
    if gemv is not None and int8.use_gemv(gemv):
        int8.max_gemv_rows = selector.max_gemv_rows(int8, dtype)
    return int8


def quantize_model(model: nn.Module, dtype: torch.dtype, native_bf16: bool,
                   selector: Int8PathSelector | None = None, gemv: Int8Gemv | None = None,
                   w8a8: W8A8Kernels | None = None) -> str:
    """Quantizes every matmul weight (`LinearBase`) in `model` to per-channel int8, in place, and
    frees its float weight; a checkpoint's own int8 (`checkpoint_int8`, from GGUF Q8_0) is used as
    it is. A tied embedding then reads its rows from the LM head's int8 weight. With `gemv`, the
    weights it supports multiply a few rows on it; with `w8a8`, every other row count multiplies
    there (W8A8) and the int8pack / widening threshold is not measured. Returns a summary."""
    from services.worker.layers.embedding import LMHead, VocabEmbedding
    from services.worker.layers.linear import LinearBase

    selector = selector or Int8PathSelector()
    embeddings = {id(m.weight): m for m in model.modules() if isinstance(m, VocabEmbedding)}
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    use_tiles = w8a8 is not None and w8a8.has_tiles and dtype == torch.bfloat16
    num_from_checkpoint = num_tied = num_gemv = num_asymmetric = 0
    gemv_rows: list[int] = []
    tile_rows: list[int] = []  # each tiled weight's limit
    float_bytes = int8_bytes = 0
    for layer in layers:
        float_bytes += layer.weight.numel() * layer.weight.element_size()
        if layer.checkpoint_int8 is not None:
            qweight, scales = layer.checkpoint_int8
            num_from_checkpoint += 1
        else:
            qweight, scales = quantize_per_channel(layer.weight)
        int8 = Int8Weight(qweight, scales, native_bf16=native_bf16)
        int8.w8a8 = w8a8
        if use_tiles:
            # With activation groups, asymmetric weights (OpenVINO's int8 compression): in a
            # fake-quantized SmolLM2-135M they kept 23.6 of 64 greedy tokens against float32 where
            # symmetric ones kept 16.9 (docs/benchmarks.md). A checkpoint's Q8_0 stays symmetric,
            # rather than rounding its integers again.
            if w8a8.group_size and layer.checkpoint_int8 is None:
                tiles = w8a8.pack_asymmetric(layer.weight)
                num_asymmetric += 1
            else:
                tiles = w8a8.pack_tiles(int8.qweight, int8.scales)
            limit = selector.max_int8_tile_rows(int8, tiles) if w8a8.measures_tile_rows else tiles.max_rows
            if limit > 0:
                int8.tiles = dataclasses.replace(tiles, max_rows=limit)
                int8_bytes += int8.tiles.data.numel()
                tile_rows.append(limit)
        int8.max_int8pack_rows = 0 if w8a8 is not None else selector.max_int8pack_rows(int8, dtype)
        int8.scales_in(dtype)
        if gemv is not None and int8.use_gemv(gemv):
            if int8.tiles is not None:
                # W8A8's tiles take the rows from one (30 layers' matmuls at 1 / 8 / 16 rows: 2.66 /
                # 3.45 / 4.51 ms against the weight-only GEMV's 2.82 / 6.72 / 11.14), and oneDNN's
                # int8 GEMM above them gives the same products, so a request's tokens do not depend
                # on how many rows share its step.
                int8.max_gemv_rows = 0
            else:
                num_gemv += 1
                if w8a8 is None:  # W8A8's int8 GEMM takes every row count above MAX_INT8_GEMV_ROWS
                    int8.max_gemv_rows = selector.max_gemv_rows(int8, dtype)
                gemv_rows.append(int8.max_gemv_rows)
        tied = embeddings.get(id(layer.weight)) if isinstance(layer, LMHead) and layer.is_tied else None
        if tied is not None:
            tied.use_int8(int8, dtype)
            num_tied += 1
        layer.use_int8(int8)
        int8_bytes += int8.nbytes
    summary = (f"{len(layers)} matmul weights int8 ({num_from_checkpoint} from the checkpoint's Q8_0), "
               f"{float_bytes / 2**20:.0f} -> {int8_bytes / 2**20:.0f} MiB, {num_tied} tied embedding on int8 rows")
    if num_gemv:
        low, high = min(gemv_rows), max(gemv_rows)
        summary += f", {num_gemv} on the int8 GEMV up to {low if low == high else f'{low}-{high}'} rows"
    if tile_rows:
        low, high = min(tile_rows), max(tile_rows)
        limit = "" if low == MAX_INT8_TILE_ROWS else f" up to {low if low == high else f'{low}-{high}'} rows"
        summary += f", W8A8 on int8 column tiles{limit} from one row"
        if len(tile_rows) < len(layers):
            summary += f" ({len(layers) - len(tile_rows)} weights on oneDNN's int8 GEMM instead)"
    if w8a8 is not None and w8a8.group_size:
        return summary + (f", activations quantized in groups of {w8a8.group_size} (W8A8), "
                          f"{num_asymmetric} weights asymmetric on the tiles")
    return summary + (", activations quantized per row above (W8A8, torch._int_mm)" if w8a8 is not None else "")
