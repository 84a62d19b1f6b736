"""W8A8's int8 column tiles (csrc/gemm_int8_tiles.c): with one activation scale per row the same
result as the oneDNN path bit for bit (the exact product of the quantized operands, scaled back by
the same row pass), with activations in groups the product of the group-quantized operands to
within float32 sums and one rounding; the rows `Int8Weight` hands them, the group size each
configuration runs, and the decoder stack on them for steps of more rows than the int8 GEMV takes
(on the GEMV below). Skipped where the library has no tiles (built without AVX512_VNNI)."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.int8_kv_cache import quantize_int8_rows
from services.worker.config import WorkerConfig, cpu_has_amx_int8, cpu_has_int8_dot
from services.worker.layers.int8_gemv import MAX_INT8_GEMV_ROWS, Int8Gemv
from services.worker.layers.int8_kernels import quantize_asymmetric, quantize_per_channel
from services.worker.layers.int8_linear import Int8PathSelector, Int8Weight, quantize_model
from services.worker.layers.w8a8 import DEFAULT_W8A8_GROUP_SIZE, W8A8Kernels, int_mm_is_exact, resolve_group_size
from services.worker.models.decode_stack import WEIGHTS_INT8, WEIGHTS_INT8_TILES
from services.worker.platforms import cpu as cpu_platform
from tests.worker.kernel_builds import library_for
from tests.worker.test_decode_stack import _run, _runner


@pytest.fixture
def library(kernel_cache):
    return library_for("native", kernel_cache)


@pytest.fixture
def kernels(library) -> W8A8Kernels:
    kernels = W8A8Kernels(library)
    if not kernels.has_tiles:
        pytest.skip("the CPU kernels have no int8 column tiles here (built without AVX512_VNNI)")
    return kernels


def _reference(kernels: W8A8Kernels, x, qweight, scales, bias):
    """The exact int32 product of the quantized rows and the weight, through the oneDNN path's passes."""
    xq, x_scales = kernels.quantize_rows(x)
    acc = (xq.long() @ qweight.long().t()).int()
    return kernels.dequantize(acc, x_scales, scales, bias, x.dtype)


# Shapes: SmolLM2's, a K not a multiple of 4 and an N not of 16 (padding), a single column.
@pytest.mark.parametrize("num_rows,n_size,k_size", [(1, 16, 4), (17, 960, 576), (40, 3072, 64), (33, 577, 37),
                                                    (300, 96, 1536), (9, 1, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiles_give_the_exact_products_scaled_back_as_the_onednn_path(kernels, num_rows, n_size, k_size, with_bias):
    g = torch.Generator().manual_seed(num_rows * n_size + k_size)
    x = (torch.randn(num_rows, k_size, generator=g) * torch.logspace(-2, 1, num_rows)[:, None]).bfloat16()
    x[0, :] = 0.0  # a row of zeros: scale 0
    qweight = torch.randint(-127, 128, (n_size, k_size), generator=g, dtype=torch.int8)
    qweight[0, :] = 127  # extreme columns: (q + 128) * 127 summed over K must not overflow
    if n_size > 1:
        qweight[1, :] = -127
    scales = torch.rand(n_size, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n_size, generator=g).bfloat16() if with_bias else None
    got = kernels.tiles(x, kernels.pack_tiles(qweight, scales), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, n_size)
    assert torch.equal(got, _reference(kernels, x, qweight, scales, bias))
    if int_mm_is_exact() and k_size % 8 == 0:
        assert torch.equal(got, kernels.linear(x, qweight, scales, bias))


def _grouped_reference(x, qweight, scales, bias, group_size):
    """float64 sum over groups of (group's int8 rows x weight) * group scale, as the tiles define it;
    qweight holds the weight's integers less their zero points (any integer dtype)."""
    out = torch.zeros(x.shape[0], qweight.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], group_size):
        q, x_scales = quantize_int8_rows(x[:, k0:k0 + group_size].float())
        out += (q.double() @ qweight[:, k0:k0 + group_size].double().t()) * x_scales.double()[:, None]
    out *= scales.double()
    return out if bias is None else out + bias.double()


def _operands(num_rows, n_size, k_size, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_rows, k_size, generator=g) * torch.logspace(-2, 1, num_rows)[:, None]).bfloat16()
    x[0, :] = 0.0
    if num_rows > 1:
        x[1, k_size // 2] = 40.0  # an outlier: per row it would flatten the rest of the row
    qweight = torch.randint(-127, 128, (n_size, k_size), generator=g, dtype=torch.int8)
    qweight[0, :] = 127
    if n_size > 1:
        qweight[1, :] = -127
    scales = torch.rand(n_size, generator=g) * 0.01 + 1e-4
    return x, qweight, scales, torch.randn(n_size, generator=g).bfloat16()


# Groups that divide K, that leave a shorter last group, and one group past K (the per-row rule).
@pytest.mark.parametrize("group_size,num_rows,n_size,k_size", [
    (32, 17, 960, 576), (64, 40, 3072, 64), (32, 33, 577, 37), (36, 300, 96, 1536), (4, 9, 1, 3),
    (128, 5, 48, 96)])
def test_grouped_tiles_give_the_group_quantized_product_within_one_rounding(library, kernels, group_size, num_rows,
                                                                             n_size, k_size):
    x, qweight, scales, bias = _operands(num_rows, n_size, k_size, seed=num_rows + k_size)
    grouped = W8A8Kernels(library, group_size=group_size)
    got = grouped.tiles(x, grouped.pack_tiles(qweight, scales), bias)
    want = _grouped_reference(x, qweight, scales, bias, group_size)
    # bfloat16's rounding, and float32 sums whose terms (the 128 offset in them) reach |x| |W| + 128 |q|.
    magnitude = (x.double().abs() @ (qweight.double().abs() + 128).t()) * scales.double()
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + magnitude * 2**-20).all()
    if group_size >= k_size:  # one group: the per-row tiles bit for bit
        assert torch.equal(got, kernels.tiles(x, kernels.pack_tiles(qweight, scales), bias))


# Groups quantized 16 at a time (16-64 values, int8_groups.h; 5 rows of 288 in groups of 32: the
# rows' groups in trees of 16 that cross rows), one at a time on 16 lanes (256), and by the scalar
# loop (36).
@pytest.mark.usefixtures("kernels")  # skips where the library has no tiles
@pytest.mark.parametrize("group_size", [16, 32, 48, 256, 36])
def test_each_groups_integers_are_the_reference_rules(library, group_size):
    """Every group holds +-127 (a scale of one) and half-integers: with the identity as the weight the
    float32 sums are exact, so each output is the group's integer itself, rounded half to even, a NaN
    0 and a zero group 0 (the kernel's sums leave a tie or a skipped NaN nowhere to hide)."""
    k_size, num_rows = 288, 5
    g = torch.Generator().manual_seed(group_size)
    x = torch.randint(-253, 254, (num_rows, k_size), generator=g).float() / 2  # -126.5 .. 126.5
    for k0 in range(0, k_size, group_size):
        x[:, k0] = 127.0
        x[1::2, k0] = -127.0
    x[2, 3] = float("nan")
    x[3, :] = 0.0
    grouped = W8A8Kernels(library, group_size=group_size)
    got = grouped.tiles(x.bfloat16(), grouped.pack_tiles(torch.eye(k_size, dtype=torch.int8), torch.ones(k_size)))
    want = torch.nan_to_num(torch.round(x), nan=0.0)  # torch.round: half to even
    assert torch.equal(got.float(), want)
    assert (x.frac().abs() == 0.5).sum() > 100  # the rows hold many ties


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("group_size", [32, 256])
def test_groups_below_127_over_flt_max_still_quantize_to_their_signs(library, group_size):
    """A group whose largest |x| is below 127 / FLT_MAX has an infinite inverse: every nonzero value
    quantizes to +-127 (x * inv is infinite, clamped) and a zero to 0 (0 * inf is NaN), as the
    scalar rule does, so the group comes back as its signs times its largest |x|. The middle row
    holds only such groups (another group's terms would swamp theirs in the row's float32 sums),
    its neighbours ordinary values: in groups of 32 the trees of 16 groups mix both kinds."""
    k_size, num_rows = 288, 3
    g = torch.Generator().manual_seed(group_size)
    x = torch.randn(num_rows, k_size, generator=g)
    x[1] = torch.randint(-1, 2, (k_size,), generator=g).float() * 2e-38
    x[1, ::16] = 1e-37  # each group's largest |x|, in both signs
    x[1, 8::16] = -1e-37
    x = x.bfloat16()
    grouped = W8A8Kernels(library, group_size=group_size)
    got = grouped.tiles(x, grouped.pack_tiles(torch.eye(k_size, dtype=torch.int8), torch.ones(k_size))).float()
    row = x[1].float()
    nonzero = row != 0
    assert nonzero.sum() > 40 and (~nonzero).sum() > 40
    want = torch.sign(row) * row.abs().max()
    assert torch.allclose(got[1][nonzero], want[nonzero], rtol=2**-6, atol=0.0)
    assert (got[1][~nonzero].abs() < 1e-39).all()
    others = x[[0, 2]].float()
    assert (got[[0, 2]] - others).abs().max() < 0.05  # ordinary groups: within their rounding


def test_groups_keep_the_values_an_outlier_flattens_per_row(library, kernels):
    """One large value in a row sets the per-row scale, so the row's small values round to a few
    levels; groups scale them apart (all but the outlier's own). The grouped product is far nearer
    the float one."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 576, generator=g)
    x[:, 7] = 60.0
    x = x.bfloat16()
    qweight = torch.randint(-127, 128, (96, 576), generator=g, dtype=torch.int8)
    qweight[:, 7] = 0  # the outlier's product is exact either way: the error is the rest of the row's
    scales = torch.full((96,), 1e-2)
    exact = (x.double() @ qweight.double().t()) * scales.double()
    tiled = kernels.pack_tiles(qweight, scales)
    per_row = (kernels.tiles(x, tiled).double() - exact).abs().mean()
    grouped = W8A8Kernels(library, group_size=32)
    in_groups = (grouped.tiles(x, tiled).double() - exact).abs().mean()
    assert in_groups * 3 < per_row  # measured 0.50 against 1.77


def test_asymmetric_weights_keep_each_channel_within_half_a_step():
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 96, generator=g)
    weight[1] = weight[1].abs() + 0.5  # all positive: the range still takes in zero
    weight[2] = -weight[2].abs()
    weight[3] = 0.0
    weight[4] = weight[4].abs() * 0.05 - 0.01  # lopsided: a symmetric step spans twice the range used
    weight[5, ::3] = 0.0
    u, zero_points, scales = quantize_asymmetric(weight)
    assert u.dtype == torch.uint8 and zero_points.dtype == torch.int32 and scales.dtype == torch.float32
    assert ((zero_points >= 0) & (zero_points <= 255)).all()
    assert zero_points[1] == 0 and zero_points[2] == 255
    assert scales[3] == 1 and (u[3].int() == zero_points[3]).all()
    restored = (u.int() - zero_points[:, None]).float() * scales[:, None]
    assert ((restored - weight).abs() <= scales[:, None] * (0.5 + 1e-5)).all()
    assert (restored[weight == 0] == 0).all()  # zero weights exact
    qweight, sym_scales = quantize_per_channel(weight[4:5])
    symmetric_error = (qweight.float() * sym_scales[:, None] - weight[4:5]).abs().mean()
    assert (restored[4] - weight[4]).abs().mean() * 1.5 < symmetric_error


# One scale per row (exact int32 sums), groups that divide K or leave a shorter last group, padding.
@pytest.mark.parametrize("group_size,num_rows,n_size,k_size", [
    (0, 40, 96, 64), (0, 9, 577, 37), (32, 17, 960, 576), (32, 33, 577, 37), (4, 9, 1, 3)])
def test_asymmetric_tiles_multiply_the_weights_less_their_zero_points(library, kernels, group_size, num_rows,
                                                                       n_size, k_size):
    x, _, _, bias = _operands(num_rows, n_size, k_size, seed=num_rows + n_size)
    g = torch.Generator().manual_seed(k_size)
    weight = torch.randn(n_size, k_size, generator=g) * 0.05 + 0.02  # ranges off centre: zero points not 128
    weight[0] = weight[0].abs()  # zero point 0: u reaches 255
    w8a8 = W8A8Kernels(library, group_size=group_size)
    tiled = w8a8.pack_asymmetric(weight)
    u, zero_points, scales = quantize_asymmetric(weight)
    assert tiled.asymmetric and torch.equal(tiled.scales, scales) and (zero_points != 128).any()
    centered = u.long() - zero_points.long()[:, None]
    got = w8a8.tiles(x, tiled, bias)
    if group_size == 0:  # the exact int32 product, through the oneDNN path's row pass
        assert torch.equal(got, _reference(kernels, x, centered, scales, bias))
        return
    want = _grouped_reference(x, centered, scales, bias, group_size)
    magnitude = (x.double().abs() @ (u.double() + zero_points.double()[:, None]).t()) * scales.double()
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + magnitude * 2**-20).all()


@pytest.mark.parametrize("group_size", [32, 0])
def test_groups_tile_the_float_weights_asymmetrically_and_keep_a_checkpoints_int8(library, kernels, group_size):
    """With activation groups each weight is tiled from its float values, asymmetric per channel (a
    checkpoint's own int8, the GGUF's Q8_0, stays as it is: symmetric); one scale per row keeps
    every weight symmetric, oneDNN's products. The layers then multiply on those tiles."""
    from tests.worker.test_quantization import _tied_model

    modules = _tied_model(torch.bfloat16)
    _, qkv, o, head = modules
    head.checkpoint_int8 = quantize_per_channel(head.weight)
    float_weights = {"qkv": qkv.weight.detach().clone(), "o": o.weight.detach().clone()}
    w8a8 = W8A8Kernels(library, group_size=group_size)
    summary = quantize_model(modules, torch.bfloat16, native_bf16=True, selector=Int8PathSelector(num_repeats=1),
                             w8a8=w8a8)
    assert "1 from the checkpoint's Q8_0" in summary
    assert not head.int8_weight.tiles.asymmetric
    assert torch.equal(head.int8_weight.tiles.scales, head.int8_weight.scales)
    for name, layer in (("qkv", qkv), ("o", o)):
        tiles = layer.int8_weight.tiles
        assert tiles.asymmetric == bool(group_size)
        want = quantize_asymmetric(float_weights[name])[2] if group_size else layer.int8_weight.scales
        assert torch.equal(tiles.scales, want)
        x = torch.randn(5, 64).bfloat16()
        assert torch.equal(layer.int8_weight.linear(x), w8a8.tiles(x, tiles))
    if group_size:
        assert "2 weights asymmetric on the tiles" in summary


def test_the_group_size_each_configuration_runs(library):
    assert resolve_group_size(-1, has_tiles=True, measures_tile_rows=False) == DEFAULT_W8A8_GROUP_SIZE
    assert resolve_group_size(-1, has_tiles=False, measures_tile_rows=False) == 0  # oneDNN: per row
    assert resolve_group_size(-1, has_tiles=True, measures_tile_rows=True) == 0  # AMX-INT8 keeps oneDNN's GEMM
    assert resolve_group_size(64, has_tiles=True, measures_tile_rows=True) == 64
    assert resolve_group_size(0, has_tiles=True, measures_tile_rows=False) == 0
    with pytest.raises(ValueError, match="--w8a8-group-size 32 needs W8A8's int8 column tiles"):
        resolve_group_size(32, has_tiles=False, measures_tile_rows=False)
    # Groups take the tiles at every row count: no AMX-INT8 timing hands rows to oneDNN's GEMM.
    assert not W8A8Kernels(library, measures_tile_rows=True, group_size=32).measures_tile_rows
    for bad in (-2, 6, 30):
        with pytest.raises(ValueError, match="--w8a8-group-size"):
            WorkerConfig(quantization="w8a8", w8a8_group_size=bad)


def test_tiles_refuse_what_they_do_not_multiply(kernels):
    tiled = kernels.pack_tiles(torch.zeros(16, 32, dtype=torch.int8), torch.ones(16))
    with pytest.raises(ValueError, match="int8 tiles"):
        kernels.tiles(torch.randn(2, 32), tiled)  # float32 activations
    with pytest.raises(ValueError, match="int8 tiles"):
        kernels.tiles(torch.randn(2, 31).bfloat16(), tiled)


def test_the_portable_build_has_no_tiles(kernel_cache):
    portable = W8A8Kernels(library_for("x86-64-v3", kernel_cache))
    assert not portable.has_tiles
    assert not W8A8Kernels(library_for("native", kernel_cache), use_tiles=False).has_tiles


def test_rows_past_the_gemv_take_the_tiles_with_the_onednn_paths_result(kernels, kernel_cache):
    qweight, scales = quantize_per_channel(torch.randn(64, 128))
    weight = Int8Weight(qweight, scales, native_bf16=True)
    assert weight.use_gemv(Int8Gemv(library_for("native", kernel_cache)))
    weight.w8a8 = kernels
    untiled = [weight.linear(torch.full((r, 128), 0.5).bfloat16()) for r in (MAX_INT8_GEMV_ROWS + 1, 200)]
    weight.tiles = kernels.pack_tiles(weight.qweight, weight.scales)
    calls = []
    tiles = kernels.tiles
    kernels.tiles = lambda x, *args: (calls.append(x.shape[0]), tiles(x, *args))[1]
    for num_rows in (1, MAX_INT8_GEMV_ROWS, MAX_INT8_GEMV_ROWS + 1, 200):
        assert weight.linear(torch.randn(num_rows, 128).bfloat16()).shape == (num_rows, 64)
    assert calls == [MAX_INT8_GEMV_ROWS + 1, 200]  # the GEMV keeps its rows
    x = torch.full((MAX_INT8_GEMV_ROWS + 1, 128), 0.5).bfloat16()
    assert torch.equal(weight.linear(x), untiled[0])
    calls.clear()
    assert weight.linear(torch.randn(3, 7, 128)).shape == (3, 7, 64)  # 3-D and float32: oneDNN's path
    assert calls == []


@pytest.mark.parametrize("num_requests,group_size", [(20, -1), (5, -1), (1, -1), (20, 0)])
def test_the_w8a8_stack_gives_the_layer_paths_hidden_states_bit_for_bit(tiny_llama_dir, kernels, num_requests,
                                                                         group_size):
    """Decode steps of 20, 5 and 1 rows run on the stack's int8 tiles (W8A8 takes them from one
    row, the int8 GEMV none), with the layer path's hidden states (which takes the same kernels, one
    call each)."""
    if cpu_has_amx_int8():
        pytest.skip("on an AMX-INT8 CPU W8A8's tiles stop at each shape's measured rows (tested with it stubbed)")
    fused_runner = _runner(tiny_llama_dir, torch.bfloat16, "w8a8", fused=True, max_num_seqs=32,
                           w8a8_group_size=group_size)
    stack = fused_runner.model.model.decode_stack
    assert stack is not None and stack.weight_kind == WEIGHTS_INT8_TILES and stack.max_gemv_rows == 0
    assert stack.act_group_size == (DEFAULT_W8A8_GROUP_SIZE if group_size == -1 else group_size)
    weights = [layer.mlp.down_proj.int8_weight for layer in fused_runner.model.model.layers]
    assert all(w.tiles is not None and w.max_gemv_rows == 0 for w in weights)
    assert all(w.tiles.asymmetric == (group_size != 0) for w in weights)  # groups: OpenVINO's asymmetric weights
    prompt_lens = [1 + i % 2 for i in range(num_requests)]  # one prefill step within the 32-token budget
    fused, fused_tokens = _run(fused_runner, prompt_lens, max_tokens=6)
    assert fused.stack_rows and max(fused.stack_rows) == num_requests
    layered, layered_tokens = _run(_runner(tiny_llama_dir, torch.bfloat16, "w8a8", fused=False, max_num_seqs=32,
                                           w8a8_group_size=group_size), prompt_lens, max_tokens=6)
    assert fused_tokens == layered_tokens
    assert len(fused.hidden) == len(layered.hidden)
    assert all(torch.equal(a, b) for a, b in zip(fused.hidden, layered.hidden))


def test_an_amx_int8_cpu_keeps_onednn_past_the_gemv_where_it_won_from_one_row(tiny_llama_dir, monkeypatch, tmp_path):
    """The choice runs on any machine: with AMX-INT8 reported and oneDNN's int8 GEMM timed faster
    from one row (stubbed), no weight gets int8 tiles and the stack runs the int8 GEMV's rows only."""
    if not (cpu_has_int8_dot() and int_mm_is_exact()):
        pytest.skip("W8A8 is refused on this CPU (no exact int8 dot products)")
    monkeypatch.setattr(cpu_platform, "cpu_has_amx_int8", lambda: True)
    monkeypatch.setattr(Int8PathSelector, "_measure_int8_tiles", lambda self, weight, tiles: 0)
    # The stubbed limits stay out of the real cache folder.
    monkeypatch.setattr(cpu_platform, "_cache_dir", lambda config: tmp_path)
    runner = _runner(tiny_llama_dir, torch.bfloat16, "w8a8", fused=True)
    stack = runner.model.model.decode_stack
    assert stack is not None and stack.weight_kind == WEIGHTS_INT8 and stack.max_num_rows == MAX_INT8_GEMV_ROWS
    layer = runner.model.model.layers[0].mlp.down_proj
    assert layer.int8_weight.tiles is None


def test_an_amx_int8_cpu_takes_the_tiles_up_to_each_shapes_measured_rows(tiny_llama_dir, kernels, monkeypatch,
                                                                          tmp_path):
    """With AMX-INT8 reported and the tiles timed faster up to 8 rows (stubbed): every weight is
    tiled up to 8 rows, the int8 GEMV takes none, the stack runs up to 8 rows on the tiles, and the
    tokens are those of the untimed tiles (the GEMM above 8 rows gives the same products)."""
    if not int_mm_is_exact():
        pytest.skip("W8A8 is refused on this CPU (no exact int8 dot products)")
    timed = []

    def measure(self, weight, tiles):
        timed.append(tuple(weight.shape))
        return 8

    monkeypatch.setattr(cpu_platform, "cpu_has_amx_int8", lambda: True)
    monkeypatch.setattr(Int8PathSelector, "_measure_int8_tiles", measure)
    monkeypatch.setattr(cpu_platform, "_cache_dir", lambda config: tmp_path)
    runner = _runner(tiny_llama_dir, torch.bfloat16, "w8a8", fused=True, max_num_seqs=32)
    stack = runner.model.model.decode_stack
    assert stack is not None and stack.weight_kind == WEIGHTS_INT8_TILES and stack.max_num_rows == 8
    weights = [layer.mlp.down_proj.int8_weight for layer in runner.model.model.layers]
    assert all(w.tiles is not None and w.tiles.max_rows == 8 and w.max_gemv_rows == 0 for w in weights)
    assert timed and len(timed) == len(set(timed))  # once per shape
    prompt_lens = [1 + i % 2 for i in range(12)]  # decode steps of 12 rows: past the stack, on the layer path
    fused, tokens = _run(runner, prompt_lens, max_tokens=6)
    assert fused.stack_rows == [] or max(fused.stack_rows) <= 8
    monkeypatch.setattr(cpu_platform, "cpu_has_amx_int8", lambda: False)
    # AMX-INT8 keeps one activation scale per row (auto): so must the untimed run.
    untimed = _runner(tiny_llama_dir, torch.bfloat16, "w8a8", fused=True, max_num_seqs=32, w8a8_group_size=0)
    _, untimed_tokens = _run(untimed, prompt_lens, max_tokens=6)
    assert tokens == untimed_tokens


def test_the_int8_tiles_limit_is_timed_once_per_shape_and_stored(kernels, tmp_path):
    """A real timing on this CPU, as an AMX-INT8 CPU would run it: the limit is 0, a grid count or
    every row count, stored per machine and read back without timing."""
    from services.worker.layers.int8_linear import ROW_GRID
    from services.worker.layers.w8a8 import MAX_INT8_TILE_ROWS

    torch.manual_seed(0)
    qweight, scales = quantize_per_channel(torch.randn(192, 128))
    weight = Int8Weight(qweight, scales, native_bf16=True)
    weight.w8a8 = kernels
    cache = tmp_path / "int8_kernel_thresholds.json"
    selector = Int8PathSelector(num_repeats=1, cache_path=cache)
    limit = selector.max_int8_tile_rows(weight, kernels.pack_tiles(qweight, scales))
    assert limit in (0, *ROW_GRID, MAX_INT8_TILE_ROWS)
    again = Int8PathSelector(cache_path=cache)
    again._measure_int8_tiles = lambda weight, tiles: pytest.fail("a stored limit was timed again")
    assert again.max_int8_tile_rows(weight, kernels.pack_tiles(qweight, scales)) == limit
