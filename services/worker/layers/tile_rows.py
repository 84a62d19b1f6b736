"""Up to how many rows a bfloat16 matmul multiplies on the column tiles (csrc/gemm_tiles.c, on
AVX512_BF16) before oneDNN's prepacked GEMM takes over, per weight shape.

Without AMX the tiles were at or ahead of oneDNN up to `MAX_TILE_ROWS` rows for every SmolLM2
shape on two AVX512_BF16 machines (docs/benchmarks.md, "Column tiles"): the limit is that constant
and nothing is timed. With AMX oneDNN multiplies on the tile unit, which may win from a few rows
on, so there the limit is measured once per weight shape: the two kernels are timed at the row
counts of `ROW_GRID`, and the tiles keep the rows up to the last count before oneDNN first won twice
in a row (never fewer than `MAX_GEMV_ROWS`, where a matmul only streams its weight). The limits are
stored per machine in the cache folder, as the int8 thresholds are, so restarts keep them and with
them their greedy output.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from services.worker.layers.gemv import Gemv, TiledWeight
from services.worker.layers.kernel_timing import ThresholdStore, best_time, last_win
from services.worker.layers.linear import MAX_GEMV_ROWS, MAX_TILE_ROWS, pack_weight, packed_linear

logger = logging.getLogger(__name__)

ROW_GRID = (16, 32, 64, 128, MAX_TILE_ROWS)  # row counts timed past MAX_GEMV_ROWS


class TileRowSelector:
    """`max_rows` of each tiled weight: MAX_TILE_ROWS, or where `is_measured` (the CPU has AMX) the
    limit timed against oneDNN for its shape, stored in `cache_path` (None: kept in memory)."""

    def __init__(self, is_measured: bool, num_repeats: int = 3, cache_path: Path | None = None):
        self.is_measured = is_measured
        self.num_repeats = num_repeats
        self.limits: dict[tuple[int, int], int] = {}  # (out, in) -> rows
        self._store = ThresholdStore(cache_path, "column-tile row limits")

    def max_rows(self, weight: torch.Tensor, tiled: TiledWeight, gemv: Gemv) -> int:
        """`weight` [N, K] bfloat16 (the plain weight, still there), `tiled` its column tiles."""
        if not self.is_measured:
            return MAX_TILE_ROWS
        key = (tiled.n_size, tiled.k_size)
        if key not in self.limits:
            self.limits[key] = self._store.get(f"bf16-tiles/{key[0]}x{key[1]}",
                                               lambda: self._measure(weight, tiled, gemv))
            logger.info("bfloat16 %dx%d: column tiles up to %d rows, oneDNN above", *key, self.limits[key])
        return self.limits[key]

    def _measure(self, weight: torch.Tensor, tiled: TiledWeight, gemv: Gemv) -> int:
        packed = pack_weight(weight)  # oneDNN's prepacked copy, for the timing only

        def tiles_win(num_rows: int) -> bool:
            x = torch.randn(num_rows, tiled.k_size).to(torch.bfloat16)
            tiles_s = self._best_time(lambda: gemv.tiles(x, tiled))
            return tiles_s <= self._best_time(lambda: packed_linear(x, packed, None))

        return last_win(ROW_GRID, tiles_win, MAX_GEMV_ROWS)[0]

    def _best_time(self, fn) -> float:
        return best_time(fn, self.num_repeats)
