"""Weight-only int8 on the bfloat16 column tiles (csrc/gemm_tiles.c, `gemm_tiles_int8w_bf16`): the
int8 weight held in the tiles' layout and widened to bfloat16 a panel at a time gives the bfloat16
tiles' sums of the same integers bit for bit (with the byte table's line order and without it), its
scales and bias to within one rounding, the rows above the int8 GEMV's in `Int8Weight.linear`, and
the decoder stack on them with the layer path's hidden states. Skipped where the library has no
column tiles (built without AVX512_BF16) and, for the platform's choice, where AMX takes int8
weights instead."""
from __future__ import annotations

import pytest
import torch

from services.worker.layers.gemv import Gemv
from services.worker.layers.int8_linear import Int8PathSelector
from services.worker.models.decode_stack import WEIGHTS_INT8_WIDENED
from tests.worker.kernel_builds import MARCHES, library_for
from tests.worker.test_decode_stack import _assert_bf16_layer_paths_results, _run, _runner

# (out, in): one panel and a half; an odd number of pairs (no byte-table order); a partial last
# tile; SmolLM2's MLP input; fewer columns than a tile; one pair.
SHAPES = [(96, 576), (37, 102), (130, 1536), (1000, 46), (20, 64), (48, 2)]


@pytest.fixture(scope="module", params=MARCHES)
def gemv(request, kernel_cache) -> Gemv:
    gemv = Gemv(library_for(request.param, kernel_cache))
    if not gemv.has_tiles:
        pytest.skip("this build has no column tiles (AVX512_BF16)")
    return gemv


def _int8(num_out: int, num_in: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (num_out, num_in), generator=gen, dtype=torch.int8)
    q[0, : min(num_in, 4)] = torch.tensor([127, -127, 0, -1], dtype=torch.int8)[: min(num_in, 4)]
    return q


@pytest.mark.parametrize("num_out,num_in", SHAPES)
def test_the_int8_tiles_give_the_bf16_tiles_sums_of_the_same_integers(gemv, num_out, num_in):
    q = _int8(num_out, num_in, num_out + num_in)
    packed_int8, packed_bf16 = gemv.pack_int8_tiles(q), gemv.pack_tiles(q.to(torch.bfloat16))
    ones = torch.ones(num_out)
    gen = torch.Generator().manual_seed(1)
    for num_rows in (1, 7, 8, 9, 37):
        x = torch.randn(num_rows, num_in, generator=gen).to(torch.bfloat16)
        assert torch.equal(gemv.int8_tiles(x, packed_int8, ones), gemv.tiles(x, packed_bf16)), num_rows


@pytest.mark.parametrize("num_out,num_in", SHAPES)
def test_scales_and_bias_are_applied_to_the_float32_sums_with_one_rounding(gemv, num_out, num_in):
    q = _int8(num_out, num_in, 7)
    gen = torch.Generator().manual_seed(2)
    scales = torch.rand(num_out, generator=gen) * 0.01 + 1e-4
    bias = torch.randn(num_out, generator=gen).to(torch.bfloat16)
    x = torch.randn(13, num_in, generator=gen).to(torch.bfloat16)
    got = gemv.int8_tiles(x, gemv.pack_int8_tiles(q), scales, bias).double()
    exact = (x.double() @ q.double().T) * scales.double() + bias.double()
    # float32 sums of exact products (relative 2^-24 per addition), then a bfloat16 rounding.
    bound = 2.0**-8 * exact.abs() + num_in * 2.0**-23 * (x.double().abs() @ q.double().abs().T) * scales.double()
    assert ((got - exact).abs() <= bound + 1e-30).all()
    with pytest.raises(ValueError):
        gemv.int8_tiles(x.float(), gemv.pack_int8_tiles(q), scales)


def test_an_int8_model_takes_the_tiles_above_the_gemv_and_the_stack_keeps_the_layer_paths_states(
        tiny_llama_dir, monkeypatch):
    """int8 weights, bfloat16 activations, the GEMV's rows lowered to 2: decode steps of 3-12 rows run
    on the stack with the int8 tiles above the GEMV, as the layer path multiplies them, with its
    hidden states bit for bit."""
    monkeypatch.setattr(Int8PathSelector, "max_gemv_rows_below_tiles", lambda self, weight: 2)
    fused_runner = _runner(tiny_llama_dir, torch.bfloat16, "int8", fused=True)
    stack = fused_runner.model.model.decode_stack
    if stack.weight_kind != WEIGHTS_INT8_WIDENED:
        pytest.skip("int8 weights are not on the column tiles here (no AVX512_BF16, or AMX takes them)")
    assert stack.tile_rows == (2,) * 4 and stack.max_num_rows > 12
    layer = fused_runner.model.model.layers[0].mlp.down_proj.int8_weight
    assert layer.widened_tiles is not None and layer.max_gemv_rows == 2
    x = torch.randn(5, layer.shape[1]).to(torch.bfloat16)
    assert torch.equal(layer.linear(x), layer.tiles_gemv.int8_tiles(x, layer.widened_tiles, layer.scales))
    prompt_lens = [2 + i % 2 for i in range(12)]  # 30 tokens: one prefill step within the 32-token budget
    fused, fused_tokens = _run(fused_runner, prompt_lens, max_tokens=6)
    assert max(fused.stack_rows) > 2
    _assert_bf16_layer_paths_results(tiny_llama_dir, prompt_lens, fused, fused_tokens, max_tokens=6,
                                     quantization="int8")
