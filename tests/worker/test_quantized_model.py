"""Whole models under `--quantization int8`: greedy tokens against the float32 model of the
dequantized weights (tiny random Llamas, untied and tied), the no-native-bf16 fallback, and GGUF
Q8_0 tensors read from the file as the int8 it holds (a tiny GGUF written with the gguf package)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import RunnerConfig
from services.worker.kv_cache import KVCacheLayout
from services.worker.layers.gguf_int8 import read_q8_0_weights, requantize_q8_0
from services.worker.layers.int8_kernels import dequantize, quantize_per_channel
from services.worker.layers.int8_linear import NO_LIMIT, Int8PathSelector
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner
from services.worker.platforms.cpu import CpuPlatform
from tests.worker.harness import VOCAB_SIZE, MiniScheduler, save_tiny_model

MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _is_matmul(name: str, tensor: torch.Tensor, tied: bool) -> bool:
    return tensor.dim() == 2 and (any(f"{m}." in name for m in MATMULS) or (tied and "embed_tokens" in name))


def _rewrite(src: Path, dst: Path, transform) -> Path:
    """A copy of model folder `src` whose matmul tensors are `transform(name, tensor)`."""
    shutil.copytree(src, dst)
    tied = json.loads((dst / "config.json").read_text()).get("tie_word_embeddings", False)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    save_file({n: transform(n, t) if _is_matmul(n, t, tied) else t for n, t in tensors.items()}, str(path))
    return dst


@pytest.fixture(scope="module")
def dequantized_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llamas (untied and tied) whose matmul weights are already per-channel int8 values, so
    the float32 model on them is the exact reference of the int8 one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("int8-models")
    untied = save_tiny_model(root / "untied-src", "llama")
    torch.manual_seed(1)
    tied_model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=256, tie_word_embeddings=True))
    tied_model.save_pretrained(str(root / "tied-src"))
    fake_quantize = lambda name, t: dequantize(*quantize_per_channel(t))  # noqa: E731
    return {"untied": _rewrite(untied, root / "untied", fake_quantize),
            "tied": _rewrite(root / "tied-src", root / "tied", fake_quantize),
            "bf16_exact": _rewrite(untied, root / "bf16-exact", _power_of_two_scales)}


def _power_of_two_scales(name: str, t: torch.Tensor) -> torch.Tensor:
    """Per-channel int8 values times a power-of-two scale: exact in bfloat16 too (8-bit integers), and
    each row keeps a +-127, so quantizing it gives back the same integers and scales."""
    qweight, scales = quantize_per_channel(t)
    return qweight.float() * torch.exp2(torch.round(torch.log2(scales)))[:, None]


def _runner(model_dir: Path, dtype: torch.dtype, quantization: str, native_bf16: bool = True,
            float32_copy: bool = False) -> ModelRunner:
    hf_config = load_config(model_dir)
    backend = TorchAttentionBackend()
    platform = CpuPlatform(dtype, backend, TorchLayerOps(), float32_copy=float32_copy, native_bf16=native_bf16,
                           quantization=quantization)
    model = load_model(model_dir, platform, config=hf_config)
    attn = model.attention_layers()
    layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, 4, dtype)
    config = RunnerConfig(block_size=4, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=2048)
    runner = ModelRunner(model, config, torch.device("cpu"), backend, layout, vocab_size=hf_config.vocab_size,
                         eos_token_ids=(2,))
    runner.initialize_kv_cache(128)
    return runner


def _greedy(runner: ModelRunner, max_tokens: int = 10) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(4)
    prompts = {f"req-{i}": torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for i, n in enumerate([23, 9, 41, 16])}
    scheduler = MiniScheduler(block_size=4, token_budget=32)  # prefill chunks of many rows, decodes of four
    for req_id, prompt in prompts.items():
        scheduler.add(req_id, prompt, max_tokens=max_tokens)
    scheduler.run(runner)
    return {req_id: scheduler.outputs(req_id) for req_id in prompts}


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("max_rows", [None, 0, NO_LIMIT])  # measured; always widened; always int8pack_mm
def test_int8_model_gives_the_greedy_tokens_of_the_dequantized_float32_model(dequantized_dirs, kind, max_rows,
                                                                            monkeypatch):
    model_dir = dequantized_dirs[kind]
    expected = _greedy(_runner(model_dir, torch.float32, "none"))
    if max_rows is not None:
        monkeypatch.setattr(Int8PathSelector, "max_int8pack_rows", lambda self, weight, dtype: max_rows)
    runner = _runner(model_dir, torch.float32, "int8")
    layers = [m for m in runner.model.modules() if getattr(m, "int8_weight", None) is not None]
    assert len(layers) == 2 * 4 + 1 + (kind == "tied")  # qkv, o, gate-up, down per layer; the head; a tied embedding
    assert _greedy(runner) == expected


@pytest.mark.parametrize("max_rows", [0, NO_LIMIT])
def test_bf16_int8_without_native_bf16_matches_the_float32_copy_path(dequantized_dirs, max_rows, monkeypatch):
    """An AVX2 CPU: the widening path multiplies in float32 and rounds once, as the float32-copy path
    of the bf16 model does; int8pack_mm takes the bf16 rows as they are. The weights are exact in
    bf16, so the reference holds the very values the int8 model multiplies by."""
    model_dir = dequantized_dirs["bf16_exact"]
    expected = _greedy(_runner(model_dir, torch.bfloat16, "none", native_bf16=False, float32_copy=True), 8)
    monkeypatch.setattr(Int8PathSelector, "max_int8pack_rows", lambda self, weight, dtype: max_rows)
    runner = _runner(model_dir, torch.bfloat16, "int8", native_bf16=False)
    head = runner.model.lm_head.int8_weight
    assert head.compute_dtype(torch.bfloat16) == torch.float32 and head.max_int8pack_rows == max_rows
    assert _greedy(runner, 8) == expected


# --- GGUF Q8_0 ---------------------------------------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's conversion reorders q/k rows for its RoPE (written here from its definition)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _q8_0(w: torch.Tensor) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0)


def _write_gguf(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """A GGUF of the tiny Llama's matmuls: Q8_0 except layer 1's v_proj (float32); returns the GGUF
    name of each checkpoint tensor written."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    names = {}
    for i in range(2):
        for hf, gg, heads in (("self_attn.q_proj", "attn_q", 4), ("self_attn.k_proj", "attn_k", 2),
                              ("self_attn.v_proj", "attn_v", 0), ("self_attn.o_proj", "attn_output", 0),
                              ("mlp.gate_proj", "ffn_gate", 0), ("mlp.up_proj", "ffn_up", 0),
                              ("mlp.down_proj", "ffn_down", 0)):
            name, w = f"model.layers.{i}.{hf}.weight", tensors[f"model.layers.{i}.{hf}.weight"]
            w = torch.from_numpy(_llama_cpp_permute(w.numpy(), heads)) if heads else w
            if (i, gg) == (1, "attn_v"):
                writer.add_tensor(f"blk.{i}.{gg}.weight", w.float().numpy())
            else:
                writer.add_tensor(f"blk.{i}.{gg}.weight", _q8_0(w), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            names[name] = f"blk.{i}.{gg}.weight"
    writer.add_tensor("output.weight", _q8_0(tensors["lm_head.weight"]), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    names["lm_head.weight"] = "output.weight"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return names


@pytest.fixture(scope="module")
def q8_0_model(tiny_llama_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A converted-looking folder (the tiny Llama with its Q8_0 tensors' dequantized values, and the
    marker naming its GGUF) beside that GGUF."""
    import gguf

    root = tmp_path_factory.mktemp("q8_0")
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    gguf_path = root / "tiny.gguf"
    _write_gguf(gguf_path, tensors)
    as_converted = lambda name, t: t if "layers.1.self_attn.v_proj" in name else torch.from_numpy(  # noqa: E731
        gguf.quants.dequantize(_q8_0(t), gguf.GGMLQuantizationType.Q8_0)).reshape(t.shape)
    folder = _rewrite(tiny_llama_dir, root / "converted", as_converted)
    (folder / "spindle-converted.txt").write_text(f"converted from {gguf_path}\n")
    return folder, gguf_path


def test_q8_0_tensors_read_as_the_per_channel_int8_of_the_values_the_file_holds(q8_0_model, tiny_llama_dir):
    import gguf

    folder, gguf_path = q8_0_model
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    weights = read_q8_0_weights(gguf_path, load_config(folder))
    assert "model.layers.1.self_attn.v_proj.weight" not in weights and len(weights) == 2 * 7 - 1 + 1
    for name, (qweight, scales) in weights.items():
        # The file's values in Hugging Face's row order (q/k permutation undone), from gguf's own dequantizer.
        held = torch.from_numpy(gguf.quants.dequantize(_q8_0(original[name]), gguf.GGMLQuantizationType.Q8_0))
        assert qweight.dtype == torch.int8 and qweight.shape == held.shape
        assert ((dequantize(qweight, scales) - held).abs() <= scales[:, None] / 2 + 1e-7).all(), name
        # Requantizing the blocks is quantizing the file's values per channel.
        q_ref, s_ref = quantize_per_channel(held)
        assert torch.equal(qweight, q_ref) and torch.allclose(scales, s_ref, rtol=1e-6, atol=0), name


def test_requantized_rows_keep_the_integers_of_their_largest_block():
    w = torch.randn(3, 64)
    w[:, 40] = 5.0  # the second block holds each row's largest value
    qweight, _ = requantize_q8_0(_q8_0(w))
    raw = _q8_0(w).reshape(3, 2, 34)
    assert torch.equal(qweight[:, 32:], torch.from_numpy(raw[:, 1, 2:].view(np.int8).copy()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loading_a_converted_gguf_folder_takes_the_q8_0_int8(q8_0_model, dtype):
    folder, gguf_path = q8_0_model
    weights = read_q8_0_weights(gguf_path, load_config(folder))
    model = _runner(folder, dtype, "int8").model
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    fused = torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.weight"][0] for p in "qkv"])
    assert torch.equal(layer0.self_attn.qkv_proj.int8_weight.qweight, fused)
    assert torch.equal(layer1.mlp.down_proj.int8_weight.qweight, weights["model.layers.1.mlp.down_proj.weight"][0])
    assert torch.equal(model.lm_head.int8_weight.qweight, weights["lm_head.weight"][0])
    # Layer 1's v_proj is float32 in the file: its fused qkv quantizes from the loaded weights.
    loaded = load_file(str(folder / "model.safetensors"))
    v_rows = quantize_per_channel(loaded["model.layers.1.self_attn.v_proj.weight"].to(dtype))[0]
    assert torch.equal(layer1.self_attn.qkv_proj.int8_weight.qweight[-32:], v_rows)
