"""A GGUF file's Q8_0 matmul weights, read from its blocks into the per-channel int8 that
`--quantization int8` multiplies on (int8_linear.py), skipping the float32 detour.

A Q8_0 block is 32 int8 values with one float16 scale d. Both int8 kernels take one scale per
output channel, so a row's blocks are requantized to the row's own scale s = max_b(d_b * max|q_b|)
/ 127: the block holding the row's largest value keeps its integers exactly, the others round once
more, to at most s / 2, the error per-channel int8 has anyway. (Keeping the per-block scales would
need a kernel that neither PyTorch's int8 GEMM nor the widening path offers without an extra
multiply per block.) This equals quantizing the file's dequantized values, which is what a float32
model loads; a bfloat16 model's weights round first, so reading the blocks keeps one rounding off.

The embedded SmolLM2-135M GGUF has one Q8_0 tensor, token_embd (the tied embedding and LM head,
the largest matmul); its other matmuls are Q4_1 and quantize from the loaded weights.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from services.worker.layers.linear import MergedLinear

logger = logging.getLogger(__name__)

Q8_0_BLOCK_BYTES = 34  # float16 scale + 32 int8
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PERMUTED_ARCHS = ("llama",)  # llama.cpp reorders q/k rows for its RoPE; transformers undoes it


def requantize_q8_0(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 data [rows, num_blocks * 34] (uint8, as `gguf.GGUFReader` gives it) -> (int8 [rows, in],
    float32 scales [rows]), per output channel."""
    rows = blocks.shape[0]
    raw = np.ascontiguousarray(blocks).reshape(rows, -1, Q8_0_BLOCK_BYTES)
    d = torch.from_numpy(np.ascontiguousarray(raw[..., :2]).view(np.float16).astype(np.float32))  # [rows, nb, 1]
    q = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8))  # [rows, nb, 32]
    values = (q.float() * d).reshape(rows, -1)  # exact in float32: 8-bit times 11-bit mantissas
    absmax = values.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    qweight = torch.round(values / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight, scales


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's q/k permutation: hf_weight = gguf_weight[indices]."""
    return torch.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def read_q8_0_weights(gguf_path: Path, hf_config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint name (Hugging Face's) -> (int8, scales) for every Q8_0 matmul weight in the file."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch_field = reader.fields["general.architecture"]
    arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode()
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    num_layers = hf_config.num_hidden_layers
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    hf_names = ["model.embed_tokens", "lm_head"] + [f"model.layers.{i}.{p}" for i in range(num_layers) for p in PROJECTIONS]
    by_gguf_name = {f"{name_map.get_name(n)}.weight": f"{n}.weight" for n in hf_names if name_map.get_name(n)}
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    weights = {}
    for tensor in reader.tensors:
        hf_name = by_gguf_name.get(tensor.name)
        if hf_name is None or tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        qweight, scales = requantize_q8_0(tensor.data)
        heads = num_heads if ".q_proj." in hf_name else num_kv_heads if ".k_proj." in hf_name else 0
        if heads and arch_name in PERMUTED_ARCHS:
            rows = unpermute_rows(qweight.shape[0], heads)
            qweight, scales = qweight[rows], scales[rows]
        weights[hf_name] = (qweight, scales)
    return weights


def attach_q8_0_weights(model: nn.Module, gguf_path: Path, hf_config) -> int:
    """Gives each matmul layer of `model` (a Llama-family model, loaded) whose checkpoint tensors are
    all Q8_0 in `gguf_path` those int8 weights as `checkpoint_int8`; returns how many layers. A
    tensor that does not match the loaded weight (an unknown layout) is left to quantize from it."""
    weights = read_q8_0_weights(gguf_path, hf_config)
    if "model.embed_tokens.weight" in weights and model.lm_head.is_tied:
        weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, int8 in weights.items():
        target, shard = name, 0
        for ckpt_name, (fused_name, index) in model.STACKED_PARAMS.items():
            if f".{ckpt_name}." in name:
                target, shard = name.replace(ckpt_name, fused_name), index
                break
        parts.setdefault(target.rsplit(".", 1)[0], {})[shard] = int8
    num_attached = 0
    for module_name, shards in parts.items():
        try:
            layer = model.get_submodule(module_name)
        except AttributeError:
            continue
        num_shards = len(layer.output_sizes) if isinstance(layer, MergedLinear) else 1
        if sorted(shards) != list(range(num_shards)):
            continue  # some of a fused layer's projections are not Q8_0: quantize it from the weights
        qweight = torch.cat([shards[i][0] for i in range(num_shards)])
        scales = torch.cat([shards[i][1] for i in range(num_shards)])
        if not _matches(qweight, scales, layer.weight):
            logger.warning("%s: Q8_0 tensor in %s differs from the loaded weight; quantizing the weight",
                           module_name, gguf_path.name)
            continue
        layer.checkpoint_int8 = (qweight, scales)
        num_attached += 1
    return num_attached


def _matches(qweight: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor) -> bool:
    """The requantized weight is within one int8 step (and bf16 rounding) of the loaded one."""
    if qweight.shape != weight.shape:
        return False
    dequantized = qweight.float() * scales[:, None]
    return bool(((dequantized - weight.float()).abs() <= scales[:, None] * 0.51 + weight.float().abs() * 2**-8).all())
