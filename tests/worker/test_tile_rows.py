"""The column tiles' row limit per bfloat16 weight shape (tile_rows.py): untimed without AMX; with
it, timed against oneDNN once per shape, stored per machine and read back at the next start."""
from __future__ import annotations

import json

import pytest
import torch

from services.worker import cpu_kernels
from services.worker.layers.gemv import Gemv, TiledWeight
from services.worker.layers.kernel_timing import last_win
from services.worker.layers.linear import MAX_GEMV_ROWS, MAX_TILE_ROWS
from services.worker.layers.tile_rows import ROW_GRID, TileRowSelector
from tests.worker.cpu_features import needs_bf16_packing


@pytest.fixture(scope="module")
def tiles(kernel_cache) -> Gemv:
    library = cpu_kernels.load_cpu_kernels(kernel_cache)
    if library is None or not Gemv(library).has_tiles:
        pytest.skip("the CPU kernels have no column tiles here (built without AVX512_BF16)")
    return Gemv(library)


def _tiled(n_size: int = 48, k_size: int = 64) -> TiledWeight:
    return TiledWeight(torch.empty(0, dtype=torch.bfloat16), n_size, k_size, MAX_TILE_ROWS)


def _fake_timing(monkeypatch, tiles_win_up_to: int) -> list[int]:
    """Stubs the timing: the tiles are faster up to `tiles_win_up_to` rows, oneDNN above; returns the
    row counts timed (each once per kernel)."""
    timed: list[int] = []

    def measure(self, weight, tiled, gemv):
        def tiles_win(num_rows: int) -> bool:
            timed.append(num_rows)
            return num_rows <= tiles_win_up_to

        return last_win(ROW_GRID, tiles_win, MAX_GEMV_ROWS)[0]

    monkeypatch.setattr(TileRowSelector, "_measure", measure)
    return timed


def test_without_amx_every_shape_takes_the_constant_untimed(monkeypatch):
    timed = _fake_timing(monkeypatch, 0)
    selector = TileRowSelector(is_measured=False)
    assert selector.max_rows(torch.empty(48, 64), _tiled(), gemv=None) == MAX_TILE_ROWS
    assert not timed and not selector.limits


@pytest.mark.parametrize("tiles_win_up_to, limit, num_timed", [(64, 64, 5), (256, 256, 5), (0, MAX_GEMV_ROWS, 2),
                                                               (16, 16, 3)])
def test_the_limit_is_the_last_win_before_onednn_wins_twice(monkeypatch, tiles_win_up_to, limit, num_timed):
    timed = _fake_timing(monkeypatch, tiles_win_up_to)
    selector = TileRowSelector(is_measured=True)
    assert selector.max_rows(torch.empty(48, 64), _tiled(), gemv=None) == limit
    assert len(timed) == num_timed  # counts past oneDNN's second win are not timed
    assert selector.max_rows(torch.empty(48, 64), _tiled(), gemv=None) == limit and len(timed) == num_timed
    assert selector.max_rows(torch.empty(96, 64), _tiled(96), gemv=None) == limit  # a new shape: timed again
    assert len(timed) == 2 * num_timed and set(selector.limits) == {(48, 64), (96, 64)}


def test_one_loss_between_wins_does_not_end_the_tiles_range(monkeypatch):
    outcomes = {16: True, 32: False, 64: True, 128: True, 256: False}

    def measure(self, weight, tiled, gemv):
        return last_win(ROW_GRID, outcomes.__getitem__, MAX_GEMV_ROWS)[0]

    monkeypatch.setattr(TileRowSelector, "_measure", measure)
    assert TileRowSelector(is_measured=True).max_rows(torch.empty(48, 64), _tiled(), gemv=None) == 128


def test_limits_are_stored_per_machine_and_read_back_after_a_restart(tmp_path, monkeypatch):
    cache = tmp_path / "bf16_tile_rows.json"
    _fake_timing(monkeypatch, 32)
    assert TileRowSelector(is_measured=True, cache_path=cache).max_rows(torch.empty(48, 64), _tiled(), None) == 32
    stored = json.loads(cache.read_text())
    assert len(stored) == 1 and next(iter(stored)).endswith("/bf16-tiles/48x64") and 32 in stored.values()

    def no_timing(self, weight, tiled, gemv):
        raise AssertionError("a stored limit was timed again")

    monkeypatch.setattr(TileRowSelector, "_measure", no_timing)
    assert TileRowSelector(is_measured=True, cache_path=cache).max_rows(torch.empty(48, 64), _tiled(), None) == 32


@needs_bf16_packing
def test_a_real_timing_gives_a_grid_limit_and_the_kernels_agree_there(tiles):
    """On this CPU (AMX or not), timed as an AMX CPU would be: the limit is a count of the grid (or the
    GEMV's), and both kernels give the same products at it."""
    from services.worker.layers.linear import pack_weight, packed_linear

    torch.manual_seed(0)
    weight = torch.randn(160, 96).bfloat16()
    tiled = tiles.pack_tiles(weight)
    limit = TileRowSelector(is_measured=True, num_repeats=1).max_rows(weight, tiled, tiles)
    assert limit in (MAX_GEMV_ROWS, *ROW_GRID)
    x = torch.randn(limit, 96).bfloat16()
    assert torch.allclose(tiles.tiles(x, tiled).float(), packed_linear(x, pack_weight(weight), None).float(),
                          rtol=2**-7, atol=1e-2)
