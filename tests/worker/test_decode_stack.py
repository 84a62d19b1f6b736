"""The compiled decoder stack (models/decode_stack.py, csrc/decode_layers.c): few-row decode steps
run every layer in one call, and must give the hidden states of the layer-by-layer path bit for
bit; steps it does not take (prefills, more rows than the GEMVs take, an int8 KV cache) keep the
layer path, and models it cannot run say why at load time."""
from __future__ import annotations

import pytest
import torch

from services.worker.config import RunnerConfig, WorkerConfig
from services.worker.kv_cache import KVCacheLayout
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner
from services.worker.models.decode_stack import WEIGHTS_BF16, WEIGHTS_BF16_TILES, WEIGHTS_INT8, DecodeStack
from services.worker.platforms import AttentionHeads, build_platform
from services.worker.layers.amx_gemm import AmxRowSelector
from services.worker.layers.tile_rows import TileRowSelector
from tests.worker.harness import VOCAB_SIZE, MiniScheduler

BLOCK_SIZE = 4
# bf16 takes the column tiles where the kernels have them (AVX512_BF16), else the plain GEMV;
# "bf16-gemv" turns the tiles off, so such machines run both.
CONFIGS = [(torch.bfloat16, "none", True), (torch.bfloat16, "none", False), (torch.float32, "int8", True),
           (torch.bfloat16, "int8", True)]
CONFIG_IDS = ["bf16", "bf16-gemv", "f32-int8", "bf16-int8"]


def _runner(model_dir, dtype: torch.dtype, quantization: str, fused: bool, kv_cache_dtype: str = "auto",
            tiles: bool = True, max_num_seqs: int = 16, w8a8_group_size: int = -1):
    hf_config = load_config(model_dir)
    config = WorkerConfig(quantization=quantization, cpu_fused_decode=fused, kv_cache_dtype=kv_cache_dtype,
                          cpu_gemm_tiles=tiles, w8a8_group_size=w8a8_group_size)
    platform = build_platform(config, torch.device("cpu"), dtype, AttentionHeads.from_hf_config(hf_config))
    model = load_model(model_dir, platform, config=hf_config)
    attn = model.attention_layers()
    layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, BLOCK_SIZE,
                           torch.int8 if kv_cache_dtype == "int8" else dtype)
    runner_config = RunnerConfig(block_size=BLOCK_SIZE, max_model_len=256, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=2048)
    runner = ModelRunner(model, runner_config, torch.device("cpu"), platform.attention_backend, layout,
                         vocab_size=hf_config.vocab_size, eos_token_ids=(2,))
    runner.initialize_kv_cache(256)
    return runner


class _Recorder:
    """Keeps every step's final hidden states, and the row counts the stack ran."""

    def __init__(self, runner: ModelRunner):
        self.hidden: list[torch.Tensor] = []
        self.stack_rows: list[int] = []
        model = runner.model
        compute_logits, greedy_tokens = model.compute_logits, model.compute_greedy_tokens
        model.compute_logits = lambda h: (self.hidden.append(h.clone()), compute_logits(h))[1]
        # bfloat16 greedy steps take the head's screen (layers/greedy_head.py) instead of the logits.
        model.compute_greedy_tokens = lambda h: (self.hidden.append(h.clone()), greedy_tokens(h))[1]
        if model.model.decode_stack is not None:
            model.model.decode_stack = _CountingStack(model.model.decode_stack, self.stack_rows)


class _CountingStack:
    def __init__(self, stack: DecodeStack, rows: list[int]):
        self.stack, self.rows, self.max_num_rows = stack, rows, stack.max_num_rows

    def accepts(self, hidden_states, attn_metadata) -> bool:
        return self.stack.accepts(hidden_states, attn_metadata)

    def __call__(self, hidden_states, rope, attn_metadata):
        self.rows.append(hidden_states.shape[0])
        return self.stack(hidden_states, rope, attn_metadata)


def _run(runner: ModelRunner, prompt_lens: list[int], max_tokens: int = 8) -> tuple[_Recorder, list[list[int]]]:
    recorder = _Recorder(runner)
    generator = torch.Generator().manual_seed(11)
    scheduler = MiniScheduler(block_size=BLOCK_SIZE, token_budget=32)  # chunked prefills beside decodes
    for i, n in enumerate(prompt_lens):
        scheduler.add(f"r{i}", torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist(), max_tokens)
    scheduler.run(runner)
    return recorder, [scheduler.outputs(f"r{i}") for i in range(len(prompt_lens))]


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])  # Qwen2: biased q/k/v
@pytest.mark.parametrize("dtype,quantization,tiles", CONFIGS, ids=CONFIG_IDS)
def test_the_stack_gives_the_layer_paths_hidden_states_bit_for_bit(model_fixture, dtype, quantization, tiles,
                                                                   request):
    model_dir = request.getfixturevalue(model_fixture)
    prompt_lens = [23, 9, 41, 16, 5]
    layered, layered_tokens = _run(_runner(model_dir, dtype, quantization, fused=False, tiles=tiles), prompt_lens)
    fused_runner = _runner(model_dir, dtype, quantization, fused=True, tiles=tiles)
    stack = fused_runner.model.model.decode_stack
    assert isinstance(stack, DecodeStack)
    if dtype == torch.bfloat16 and quantization == "none" and not tiles:
        assert stack.weight_kind == WEIGHTS_BF16
    fused, fused_tokens = _run(fused_runner, prompt_lens)
    assert fused.stack_rows and max(fused.stack_rows) <= stack.max_num_rows
    assert len(fused.stack_rows) < len(fused.hidden)  # the prefill steps kept the layer path
    assert fused_tokens == layered_tokens
    assert len(fused.hidden) == len(layered.hidden)
    for step, (a, b) in enumerate(zip(fused.hidden, layered.hidden)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a.float() - b.float()).abs().max()}"


def test_the_tiled_stack_takes_steps_of_more_rows_than_the_plain_gemv(tiny_llama_dir):
    """Twelve requests: decode steps of 9-12 rows, above the plain GEMV's 8, run on the stack where
    the weights are in column tiles, with the layer path's hidden states."""
    fused_runner = _runner(tiny_llama_dir, torch.bfloat16, "none", fused=True)
    if fused_runner.model.model.decode_stack.weight_kind != WEIGHTS_BF16_TILES:
        pytest.skip("the CPU kernels have no column tiles here (built without AVX512_BF16)")
    prompt_lens = [2 + i % 2 for i in range(12)]  # 30 tokens: one prefill step within the 32-token budget
    fused, fused_tokens = _run(fused_runner, prompt_lens, max_tokens=6)
    assert max(fused.stack_rows) > 8
    _assert_bf16_layer_paths_results(tiny_llama_dir, prompt_lens, fused, fused_tokens, max_tokens=6)


def test_the_tiled_stack_takes_steps_above_the_tiles_on_the_amx_gemm(tiny_llama_dir, monkeypatch):
    """The tiles' limit lowered to 6 rows: decode steps of 7-12 rows run on the stack with the AMX GEMM
    above the tiles, as the layer path multiplies them, with its hidden states bit for bit."""
    monkeypatch.setattr(TileRowSelector, "max_rows", lambda self, weight, tiled, gemv: 6)
    fused_runner = _runner(tiny_llama_dir, torch.bfloat16, "none", fused=True)
    stack = fused_runner.model.model.decode_stack
    if stack.weight_kind != WEIGHTS_BF16_TILES or not all(stack.amx_rows):
        pytest.skip("no AMX GEMM above the column tiles here (a CPU without AMX-BF16)")
    assert stack.tile_rows == (6,) * 4 and stack.max_num_rows == min(stack.amx_rows) > 12
    prompt_lens = [2 + i % 2 for i in range(12)]  # 30 tokens: one prefill step within the 32-token budget
    fused, fused_tokens = _run(fused_runner, prompt_lens, max_tokens=6)
    assert max(fused.stack_rows) > 6
    _assert_bf16_layer_paths_results(tiny_llama_dir, prompt_lens, fused, fused_tokens, max_tokens=6)


def test_the_int8_stack_takes_steps_above_the_int8_gemv_on_the_amx_gemm(tiny_llama_dir, monkeypatch):
    """int8 weights, bfloat16 activations, the int8 GEMV's rows lowered to 2: decode steps of 3-12 rows
    run on the stack with the int8 AMX GEMM above the GEMV, as the layer path multiplies them, with its
    hidden states bit for bit."""
    monkeypatch.setattr(AmxRowSelector, "int8_rows", lambda self, int8, gemm: (2, 64))
    fused_runner = _runner(tiny_llama_dir, torch.bfloat16, "int8", fused=True)
    stack = fused_runner.model.model.decode_stack
    if stack.weight_kind != WEIGHTS_INT8 or not all(stack.amx_rows):
        pytest.skip("no AMX GEMM for int8 weights here (a CPU without AMX-BF16)")
    assert stack.tile_rows == (2,) * 4 and stack.amx_rows == (64,) * 4 and stack.max_num_rows == 64
    prompt_lens = [2 + i % 2 for i in range(12)]  # 30 tokens: one prefill step within the 32-token budget
    fused, fused_tokens = _run(fused_runner, prompt_lens, max_tokens=6)
    assert max(fused.stack_rows) > 2
    _assert_bf16_layer_paths_results(tiny_llama_dir, prompt_lens, fused, fused_tokens, max_tokens=6,
                                     quantization="int8")


def _assert_bf16_layer_paths_results(model_dir, prompt_lens: list[int], fused: _Recorder, fused_tokens,
                                     max_tokens: int, quantization: str = "none"):
    """A bfloat16 runner without the stack (built under the caller's patches) gives the same tokens and
    every step's hidden states bit for bit."""
    layered, layered_tokens = _run(_runner(model_dir, torch.bfloat16, quantization, fused=False), prompt_lens,
                                   max_tokens=max_tokens)
    assert fused_tokens == layered_tokens
    for step, (a, b) in enumerate(zip(fused.hidden, layered.hidden)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "gemv"])
def test_steps_of_more_rows_than_the_gemv_takes_keep_the_layer_path(tiny_llama_dir, tiles, monkeypatch):
    # The tiles' limit (256 rows) and the AMX GEMM's above them lowered, so that a small runner can
    # run steps above both.
    monkeypatch.setattr(TileRowSelector, "max_rows", lambda self, weight, tiled, gemv: 6)
    monkeypatch.setattr(AmxRowSelector, "max_rows", lambda self, weight, gemm, min_rows: 9)
    runner = _runner(tiny_llama_dir, torch.bfloat16, "none", fused=True, tiles=tiles)
    stack = runner.model.model.decode_stack
    prompt_lens = [5 + i for i in range(stack.max_num_rows + 2)]
    fused, fused_tokens = _run(runner, prompt_lens, max_tokens=6)
    assert any(h.shape[0] > stack.max_num_rows for h in fused.hidden)  # such steps ran...
    assert all(rows <= stack.max_num_rows for rows in fused.stack_rows)  # ...and not on the stack
    _, layered_tokens = _run(_runner(tiny_llama_dir, torch.bfloat16, "none", fused=False, tiles=tiles), prompt_lens,
                             max_tokens=6)
    assert fused_tokens == layered_tokens


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("dtype,quantization,tiles",
                         [(torch.bfloat16, "none", True), (torch.bfloat16, "int8", True),
                          (torch.float32, "int8", True)],
                         ids=["bf16", "bf16-int8", "f32-int8"])
def test_over_an_int8_kv_cache_the_stack_gives_the_layer_paths_hidden_states_bit_for_bit(
        model_fixture, dtype, quantization, tiles, request):
    """The int8 cache's rows written by its compiled writer and read by its decode kernel, inside the
    stack as on the layer path: the same hidden states, and the same int8 cache bytes after the run."""
    model_dir = request.getfixturevalue(model_fixture)
    prompt_lens = [23, 9, 41, 16, 5]
    layered_runner = _runner(model_dir, dtype, quantization, fused=False, kv_cache_dtype="int8", tiles=tiles)
    layered, layered_tokens = _run(layered_runner, prompt_lens)
    fused_runner = _runner(model_dir, dtype, quantization, fused=True, kv_cache_dtype="int8", tiles=tiles)
    stack = fused_runner.model.model.decode_stack
    assert isinstance(stack, DecodeStack) and stack.kv_int8
    fused, fused_tokens = _run(fused_runner, prompt_lens)
    assert fused.stack_rows and max(fused.stack_rows) <= stack.max_num_rows
    assert fused_tokens == layered_tokens
    assert len(fused.hidden) == len(layered.hidden)
    for step, (a, b) in enumerate(zip(fused.hidden, layered.hidden)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a.float() - b.float()).abs().max()}"
    pairs = zip(fused_runner.model.attention_layers(), layered_runner.model.attention_layers())
    for fused_layer, layered_layer in pairs:
        assert fused_layer.kv_cache.dtype == torch.int8 and torch.equal(fused_layer.kv_cache, layered_layer.kv_cache)


def test_a_model_off_the_gemvs_gets_no_stack_and_the_log_says_why(tiny_llama_dir, caplog):
    caplog.set_level("INFO", logger="services.worker.model_loader")
    runner = _runner(tiny_llama_dir, torch.float32, "none", fused=True)  # float32 weights: oneDNN, no GEMV
    assert runner.model.model.decode_stack is None
    assert "decode layers one by one (QKVLinear not on a GEMV for torch.float32)" in caplog.text
    assert _runner(tiny_llama_dir, torch.bfloat16, "none", fused=False).model.model.decode_stack is None
