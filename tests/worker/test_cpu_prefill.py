"""The compiled CPU prefill-attention kernel (csrc/paged_prefill.c) against the dense float64
reference of tests/oracles.py and against PyTorch's SDPA path: ragged prefill and chunk slices in
one call over blocks out of order, GQA groups 1, 3 and 4, head sizes 32 to 256, strided queries
from the fused projection, rows outside the slices untouched; the CPU backend's routing; the
argument checks; a model's forward on the CPU platform.

Tolerance (bfloat16 only): the kernel rounds the probabilities to bfloat16 before weighting the
values, as GPU flash attention does, sums in float32 and rounds each output once to bfloat16.
Against the float64 reference on the same rounded inputs: TOLERANCES[bfloat16] = 1e-2 per element
as atol = rtol (seen 8.9e-3 at outputs up to 3.3, where one output rounding alone is up to 7.8e-3,
and the same for SDPA), and a mean absolute error under MAX_MEAN_ERROR = 1e-3 (seen 3.1e-4, as
SDPA's): the mean catches a small systematic error that the per-element bound would let through.

The kernel exists where the library is built for AVX512_BF16; elsewhere those tests skip, and one
test checks that `supports` is then False.
"""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.cpu_prefill import PagedPrefillKernel, PrefillSlices, build_prefill_slices
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import WorkerConfig
from services.worker.cpu_kernels import MARCH_FEATURES, _cpu_flags, load_cpu_kernels
from services.worker.kv_cache import KVCacheLayout, allocate_kv_caches
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.model_loader import load_config, load_model
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.platforms.cpu import CpuPlatform
from tests.kernels.paged_batch import TOLERANCES, check_batch, make_batch
from tests.oracles import dense_attention

TOL = TOLERANCES[torch.bfloat16]
MAX_MEAN_ERROR = 1e-3
# (tokens in the cache, tokens this step): a fresh prompt (not a whole block or tile), a decode
# (its row must stay untouched), a chunk starting mid-block, a chunk over a short context, a
# two-token prompt, a chunk over more than one 64-key tile and 96-row work item, a last decode.
RAGGED = ((0, 37), (3, 1), (45, 24), (13, 70), (0, 2), (100, 130), (0, 1))


@pytest.fixture(scope="module")
def library(kernel_cache):
    library = load_cpu_kernels(kernel_cache)
    assert library is not None, "the CPU kernels must build here (gcc is on every CI machine)"
    return library


@pytest.fixture(scope="module")
def kernel(library) -> PagedPrefillKernel:
    kernel = PagedPrefillKernel(library)
    if not kernel.is_available:
        pytest.skip("this CPU lacks AVX512_BF16: the library has no prefill kernel (prefills stay on SDPA)")
    return kernel


def _cache_with_step_kv(batch) -> torch.Tensor:
    """The batch's cache with this step's K/V written at their slots, as the layer's fused RoPE +
    cache write leaves it before attention."""
    cache = batch.kv_cache.clone()
    num_kv_heads, head_dim = batch.key.shape[1:]
    cache[0].view(-1, num_kv_heads, head_dim)[batch.common.slot_mapping] = batch.key
    cache[1].view(-1, num_kv_heads, head_dim)[batch.common.slot_mapping] = batch.value
    return cache


def _run(kernel: PagedPrefillKernel, batch, scale: float) -> torch.Tensor:
    """The kernel over the batch's prefill slices, into an output full of NaN."""
    cache = _cache_with_step_kv(batch)
    out = torch.full((batch.query.shape[0], batch.query.shape[1] * batch.query.shape[2]), float("nan"),
                     dtype=torch.bfloat16)
    kernel(batch.query, cache[0], cache[1], build_prefill_slices(batch.common), out, scale)
    return out


def _check_prefills(out: torch.Tensor, batch, scale: float, attention=dense_attention) -> None:
    """Each prefill slice's rows against the reference (per element, then the mean error); the
    decode rows, outside every slice, still NaN."""
    start, errors = 0, []
    for i, r in enumerate(batch.dense):
        rows = slice(start, start + r.query_len)
        start += r.query_len
        if r.query_len == 1:
            assert out[rows].isnan().all(), f"request {i}: a row outside the slices was written"
            continue
        expected = attention(batch.query[rows], r.keys, r.values, r.context_len, scale)
        torch.testing.assert_close(out[rows].double(), expected, atol=TOL, rtol=TOL,
                                   msg=lambda m, i=i, r=r: f"request {i} (context {r.context_len}, "
                                                           f"{r.query_len} queries): {m}")
        errors.append((out[rows].double() - expected).abs().flatten())
    mean_error = float(torch.cat(errors).mean())
    assert mean_error < MAX_MEAN_ERROR, f"mean error {mean_error:.2e}"


# (query heads, KV heads, head size, block size): SmolLM2-135M's heads (group 3), group 4 with 128
# dims, group 1, group 4 over blocks of 4 (tiles span many blocks), 32 and 256 dims.
SHAPES = [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 32), (16, 4, 64, 4), (2, 2, 32, 8), (6, 2, 256, 16)]


@pytest.mark.parametrize("heads,kv_heads,dim,bs", SHAPES, ids=lambda v: str(v))
def test_ragged_slices_in_one_call_match_the_dense_reference(kernel, heads, kv_heads, dim, bs):
    batch = make_batch(heads, kv_heads, dim, torch.bfloat16, block_size=bs, requests=RAGGED, seed=heads * dim + bs,
                       fused_qkv=True)
    assert batch.query.stride(0) == (heads + 2 * kv_heads) * dim  # the q part of the fused projection
    _check_prefills(_run(kernel, batch, dim**-0.5), batch, dim**-0.5)


@pytest.mark.parametrize("requests", [((0, 290),), ((768, 256),), ((0, 290),) * 3], ids=["290", "256@768", "3x290"])
def test_long_slices_match_the_dense_reference(kernel, requests):
    """The benchmark's shapes: many work items per KV head, spread over the threads."""
    batch = make_batch(9, 3, 64, torch.bfloat16, requests=requests, seed=len(requests), fused_qkv=True)
    _check_prefills(_run(kernel, batch, 0.125), batch, 0.125)


def test_the_kernel_agrees_with_sdpa(kernel):
    """The prefill rows against the PyTorch backend's SDPA path on the same batch, each off from
    the float64 reference by its own output rounding."""
    batch = make_batch(9, 3, 64, torch.bfloat16, requests=RAGGED, seed=3, fused_qkv=True)
    sdpa = TorchAttentionBackend()
    expected = sdpa.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                            sdpa.build_metadata(batch.common), 0.125)
    out = _run(kernel, batch, 0.125)
    rows = torch.tensor([n > 1 for _, n in RAGGED]).repeat_interleave(torch.tensor([n for _, n in RAGGED]))
    torch.testing.assert_close(out[rows].double(), expected[rows].double(), atol=TOL, rtol=TOL)


def test_the_output_does_not_depend_on_the_number_of_threads(kernel):
    """Each work item is one thread's, summed in a fixed order: one thread or several, the same bits."""
    batch = make_batch(9, 3, 64, torch.bfloat16, requests=RAGGED, seed=4, fused_qkv=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _run(kernel, batch, 0.125)
        torch.set_num_threads(max(2, before))
        shared = _run(kernel, batch, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone.nan_to_num(), shared.nan_to_num())


def test_the_check_tells_a_wrong_reference_apart(kernel):
    """The kernel's output fails the same check against a reference whose queries see one key
    less (the causal mask one short), or whose scale is 1% off."""
    batch = make_batch(9, 3, 64, torch.bfloat16, requests=RAGGED, seed=5, fused_qkv=True)
    out = _run(kernel, batch, 0.125)
    _check_prefills(out, batch, 0.125)

    def one_short(q, k, v, context_len, scale):
        # query j sees keys 0 .. context_len + j - 1 (the first query keeps key 0)
        scores_mask = torch.arange(k.shape[0])[None, :] < torch.arange(context_len, context_len + q.shape[0])[:, None]
        scores_mask[:, 0] = True
        group = q.shape[1] // k.shape[1]
        kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
        w = torch.softmax(s.masked_fill(~scores_mask, float("-inf")), -1)
        return torch.einsum("hqk,khd->qhd", w, vv).reshape(q.shape[0], -1)

    def scale_off(q, k, v, context_len, scale):
        return dense_attention(q, k, v, context_len, scale * 1.01)

    for wrong in (one_short, scale_off):
        with pytest.raises(AssertionError):
            _check_prefills(out, batch, 0.125, attention=wrong)


class CountingPrefillKernel(PagedPrefillKernel):
    def __init__(self, library):
        super().__init__(library)
        self.num_calls = 0

    def __call__(self, *args, **kwargs):
        self.num_calls += 1
        return super().__call__(*args, **kwargs)


def test_the_cpu_backend_attends_a_steps_prefills_in_one_kernel_call(kernel, library):
    """A mixed step (prefills, chunks, decodes): the slices' arrays are built once in the step's
    metadata, all prefills go to one kernel call, decodes to the decode kernel; the whole output
    matches the reference."""
    counting = CountingPrefillKernel(library)
    backend = CpuAttentionBackend(PagedDecodeKernel(library), counting)
    batch = make_batch(9, 3, 64, torch.bfloat16, requests=RAGGED, seed=6, fused_qkv=True)
    metadata = backend.build_metadata(batch.common)
    slices = metadata.prefill
    assert isinstance(slices, PrefillSlices)
    prefill_rows = [i for i, (_, n) in enumerate(RAGGED) if n > 1]
    starts = batch.common.query_start_loc.tolist()
    assert slices.query_starts.tolist() == [starts[i] for i in prefill_rows]
    assert slices.query_lens.tolist() == [RAGGED[i][1] for i in prefill_rows]
    assert slices.seq_lens.tolist() == [sum(RAGGED[i]) for i in prefill_rows]
    for row, i in zip(slices.block_table.tolist(), prefill_rows):
        assert row[: len(batch.tables[i])] == batch.tables[i][: len(row)]
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), metadata, 0.125)
    assert counting.num_calls == 1
    check_batch(out, batch, 0.125, TOL)


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.bfloat16, 48)], ids=["float32", "bf16-dim48"])
def test_the_cpu_backend_keeps_sdpa_where_the_kernel_does_not_serve(library, dtype, dim):
    """A float32 cache, or a head size the kernel refuses (48 is not a multiple of 32): SDPA,
    and the same output as the reference."""
    counting = CountingPrefillKernel(library)
    backend = CpuAttentionBackend(PagedDecodeKernel(library), counting)
    batch = make_batch(4, 2, dim, dtype, requests=RAGGED, seed=7)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                          backend.build_metadata(batch.common), dim**-0.5)
    assert counting.num_calls == 0
    check_batch(out, batch, dim**-0.5, TOLERANCES[dtype])


def test_an_all_decode_step_builds_no_prefill_arrays(library):
    backend = CpuAttentionBackend(PagedDecodeKernel(library), PagedPrefillKernel(library))
    batch = make_batch(4, 2, 64, torch.bfloat16, requests=[(5, 1), (17, 1)])
    assert backend.build_metadata(batch.common).prefill is None


def test_supports_is_false_exactly_where_the_library_has_no_avx512_bf16_path(library, kernel_cache, monkeypatch):
    """Runs on every CPU: the library built for this CPU has the kernel exactly when the CPU has
    AVX512_BF16; the portable x86-64-v3 build never has it, so `supports` is False and a call says why."""
    native = PagedPrefillKernel(library)
    assert native.is_available == ({"avx512f", "avx512_bf16"} <= _cpu_flags())
    assert native.supports(torch.bfloat16, 64, 9, 3) == native.is_available
    if MARCH_FEATURES["x86-64-v3"] - _cpu_flags():
        pytest.skip("this CPU cannot run x86-64-v3 code")
    monkeypatch.setenv("SPINDLE_CPU_KERNEL_MARCH", "x86-64-v3")
    portable = PagedPrefillKernel(load_cpu_kernels(kernel_cache))
    assert not portable.is_available
    assert not portable.supports(torch.bfloat16, 64, 9, 3)
    batch = make_batch(9, 3, 64, torch.bfloat16, requests=[(0, 5)])
    with pytest.raises(ValueError, match="AVX512_BF16"):
        _run(portable, batch, 0.125)


def test_supports_only_bfloat16_and_the_shapes_the_kernel_takes(kernel):
    assert kernel.supports(torch.bfloat16, 64, num_heads=9, num_kv_heads=3)
    assert kernel.supports(torch.bfloat16, 256, num_heads=16, num_kv_heads=1)
    assert not kernel.supports(torch.float32, 64, 9, 3)
    assert not kernel.supports(torch.float16, 64, 9, 3)
    assert not kernel.supports(torch.bfloat16, 48, 9, 3)  # not a multiple of 32
    assert not kernel.supports(torch.bfloat16, 288, 9, 3)  # over 256
    assert not kernel.supports(torch.bfloat16, 64, 17, 1)  # 17 query heads per KV head
    assert not kernel.supports(torch.bfloat16, 64, 9, 2)  # uneven groups


def _slices(batch, **changes) -> PrefillSlices:
    s = build_prefill_slices(batch.common)
    fields = dict(query_starts=s.query_starts, query_lens=s.query_lens, seq_lens=s.seq_lens, block_table=s.block_table)
    fields.update({k: torch.tensor(v, dtype=torch.int64) for k, v in changes.items()})
    return PrefillSlices(**fields)


def test_bad_arguments_raise_value_errors_not_crashes(kernel):
    batch = make_batch(4, 2, 64, torch.bfloat16, requests=[(0, 5), (20, 9)])
    cache = _cache_with_step_kv(batch)
    out = torch.zeros(batch.query.shape[0], 4 * 64, dtype=torch.bfloat16)
    good = build_prefill_slices(batch.common)
    num_blocks = cache.shape[1]
    cases = [
        ((batch.query.float(), cache[0], cache[1], good, out), "bfloat16"),
        ((batch.query, cache[0], cache[1], good, out[:, :128]), "out must be"),
        ((batch.query.transpose(1, 2).contiguous().transpose(1, 2), cache[0], cache[1], good, out), "contiguous"),
        ((batch.query, cache[0][:, :, :1], cache[1], good, out), "do not fit"),
        ((batch.query, cache[0], cache[1], _slices(batch, block_table=[[num_blocks] * 3, [1] * 3]), out),
         "out of range"),  # a block id past the cache
        ((batch.query, cache[0], cache[1], _slices(batch, seq_lens=[5, 8]), out), "out of range"),  # seq < queries
        ((batch.query, cache[0], cache[1], _slices(batch, query_starts=[0, 10]), out), "out of range"),  # past T
        ((batch.query, cache[0], cache[1], _slices(batch, seq_lens=[5, 60]), out), "out of range"),  # table too short
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            kernel(*args, 0.125)
    with pytest.raises(ValueError, match="int64"):
        _slices(batch, query_lens=[5])  # one length for two slices
    odd = make_batch(3, 1, 48, torch.bfloat16, requests=[(0, 5)])
    odd_cache = _cache_with_step_kv(odd)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel(odd.query, odd_cache[0], odd_cache[1], build_prefill_slices(odd.common),
               torch.zeros(5, 3 * 48, dtype=torch.bfloat16), 0.125)


# --- through a model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_64_dir(tmp_path_factory):
    """A 2-layer random Llama with heads of 64 (4 query heads sharing 2 KV heads), attention
    sharpened as in tests/worker/harness.py so that positions and masking matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         tie_word_embeddings=False))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("llama-64")
    model.save_pretrained(str(path))
    return path


def _two_chunks(model, platform, num_tokens: int = 53, first_chunk: int = 23) -> torch.Tensor:
    """A prompt prefilled in two chunks over scattered blocks of 16 (the second with 23 tokens of
    context, starting mid-block) -> the hidden states of both chunks' tokens."""
    layers = model.attention_layers()
    layout = KVCacheLayout(len(layers), layers[0].num_kv_heads, layers[0].head_dim, 16, platform.dtype)
    for layer, cache in zip(layers, allocate_kv_caches(layout, 8, platform.attention_backend, platform.device)):
        layer.kv_cache = cache
    blocks = [5, 2, 7, 3]
    token_ids = torch.arange(3, 3 + num_tokens) * 7 % 500
    hidden = []
    for start, end in ((0, first_chunk), (first_chunk, num_tokens)):
        positions = torch.arange(start, end)
        slots = torch.tensor([blocks[p // 16] * 16 + p % 16 for p in range(start, end)])
        common = CommonAttentionMetadata(torch.tensor([0, end - start]), torch.tensor([end]), slots,
                                         torch.tensor([blocks]), 16, [end - start], [end])
        with torch.inference_mode():
            hidden.append(model(token_ids[start:end], positions, platform.attention_backend.build_metadata(common)))
    return torch.cat(hidden)


def _relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.double() - reference.double()).norm() / reference.double().norm())


def test_a_bfloat16_model_prefills_through_the_kernel_as_accurately_as_through_sdpa(kernel, llama_64_dir,
                                                                                     fresh_kernel_cache, monkeypatch):
    """The CPU platform for a bfloat16 model with heads of 64 attends its prefills with the kernel
    (one call per layer and chunk). The hidden states of a prompt prefilled in two chunks are as
    close to the float32 model's (PyTorch throughout) as those of the same platform with SDPA
    prefills: bfloat16 weights and activations dominate (seen 2.92e-2 and 2.85e-2 relative), and
    the two bfloat16 runs differ by less than that (seen 8.8e-3)."""
    calls = []
    monkeypatch.setattr(PagedPrefillKernel, "__call__",
                        lambda self, *args, _call=PagedPrefillKernel.__call__: calls.append(1) or _call(self, *args))
    hf_config = load_config(llama_64_dir)
    platform = build_platform(WorkerConfig(cache_dir=str(fresh_kernel_cache)), torch.device("cpu"), torch.bfloat16,
                              AttentionHeads.from_hf_config(hf_config))
    backend = platform.attention_backend
    assert isinstance(backend, CpuAttentionBackend) and backend.prefill_kernel is not None
    hidden = _two_chunks(load_model(llama_64_dir, platform, config=hf_config), platform)
    assert len(calls) == 2 * hf_config.num_hidden_layers
    sdpa_platform = CpuPlatform(torch.bfloat16, CpuAttentionBackend(backend.decode.kernel), platform.layer_ops,
                                float32_copy=False)
    sdpa = _two_chunks(load_model(llama_64_dir, sdpa_platform, config=hf_config), sdpa_platform)
    assert len(calls) == 2 * hf_config.num_hidden_layers  # the SDPA platform made no kernel call
    float32_platform = CpuPlatform(torch.float32, TorchAttentionBackend(), TorchLayerOps(), float32_copy=False)
    reference = _two_chunks(load_model(llama_64_dir, float32_platform, config=hf_config), float32_platform)
    kernel_error, sdpa_error = _relative_error(hidden, reference), _relative_error(sdpa, reference)
    assert kernel_error < 1.1 * sdpa_error, (kernel_error, sdpa_error)
    assert _relative_error(hidden, sdpa) < 0.5 * sdpa_error
