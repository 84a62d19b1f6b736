"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) on our own layers.

Input is a flat batch: every request's scheduled tokens concatenated ([T] ids and positions), no
padding. q/k/v and gate/up are fused projections; `load_weights` splits checkpoint tensors into
them. Attention goes through the paged KV cache bound to each `Attention` layer. The worker's
platform is given at construction: its attention backend and layer ops (the compiled CPU kernels,
or PyTorch) go to the layers that call them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from services.worker.attention.backend import AttentionMetadata
from services.worker.layers.activation import get_act_and_mul
from services.worker.layers.attention import Attention
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.layer_ops import LayerOps
from services.worker.layers.layernorm import RMSNorm
from services.worker.layers.linear import Linear, MergedLinear, QKVLinear
from services.worker.layers.rotary_embedding import get_rope
from services.worker.models.decode_stack import DecodeLayersKernel, DecodeStack, attach_decode_stack
from services.worker.platforms.interface import Platform


def _rope_parameters(config) -> dict:
    # transformers 5 standardises RoPE settings into `rope_parameters`; older configs use
    # `rope_theta` and `rope_scaling`.
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class LlamaAttention(nn.Module):
    def __init__(self, config, platform: Platform, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, o_bias)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, _rope_parameters(config))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                              platform.attention_backend, platform.layer_ops)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """`rope`: this step's (cos, sin) from `rotary_emb.cos_sin`, the same for every layer."""
        return self.o_proj(self.attn(self.qkv_proj(hidden_states), rope, attn_metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config, bias: bool, ops: LayerOps):
        super().__init__()
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias)
        self.act_fn = get_act_and_mul(config.hidden_act, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, platform: Platform, qkv_bias: bool, o_bias: bool):
        super().__init__()
        ops = platform.layer_ops
        self.self_attn = LlamaAttention(config, platform, qkv_bias, o_bias)
        self.mlp = LlamaMLP(config, getattr(config, "mlp_bias", False), ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, rope, hidden_states, residual, attn_metadata):
        # The residual add is fused into the next norm: (norm(x + r), x + r).
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config, platform: Platform, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, platform, qkv_bias, o_bias) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, platform.layer_ops)
        # All of a few-row decode step's layers in one compiled call, where the CPU platform
        # attached one (decode_stack.py); same kernels, same results.
        self.decode_stack: DecodeStack | None = None

    def forward(self, input_ids, positions, attn_metadata) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        rope = self.layers[0].self_attn.rotary_emb.cos_sin(positions, hidden_states.dtype)
        if self.decode_stack is not None and self.decode_stack.accepts(hidden_states, attn_metadata):
            return self.decode_stack(hidden_states, rope, attn_metadata)
        for layer in self.layers:
            hidden_states, residual = layer(rope, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection name -> (our fused parameter's module name, shard index).
    STACKED_PARAMS = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    QKV_BIAS: bool | None = None  # None: follow config.attention_bias
    O_BIAS: bool | None = None

    def __init__(self, config, platform: Platform):
        super().__init__()
        self.config = config
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if self.QKV_BIAS is None else self.QKV_BIAS
        o_bias = attention_bias if self.O_BIAS is None else self.O_BIAS
        self.model = LlamaModel(config, platform, qkv_bias, o_bias)
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat token batch."""
        return self.model(input_ids, positions, attn_metadata)

    def fuse_decode_layers(self, kernel: DecodeLayersKernel) -> str:
        """Runs few-row decode steps' layers as one call of `kernel` where they all qualify; says
        which, for the load log."""
        why_not = attach_decode_stack(self.model, kernel)
        if why_not:
            return f"decode layers one by one ({why_not})"
        return f"decode layers in one call up to {self.model.decode_stack.max_num_rows} rows"

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    @property
    def has_greedy_head_screen(self) -> bool:
        return self.lm_head.greedy_screen is not None

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of `compute_logits` from the head's greedy screen (layers/greedy_head.py);
        None where the screen leaves it to the full head (a row not finite, or more rows than the
        screen is faster at)."""
        screen = self.lm_head.greedy_screen
        return screen(hidden_states) if screen.takes(hidden_states.shape[0]) else None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into parameters (casting dtype); returns the names it filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head.is_tied:
                continue  # some tied checkpoints store the shared matrix twice
            for ckpt_name, (fused_name, shard) in self.STACKED_PARAMS.items():
                if f".{ckpt_name}." in name:
                    target = name.replace(ckpt_name, fused_name)
                    module = self.get_submodule(target.rsplit(".", 1)[0])
                    module.load_shard(_param(params, target), tensor, shard)
                    loaded.add(target)
                    break
            else:
                param = _param(params, name)
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
        return loaded


def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    if name not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no matching parameter")
    return params[name]


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    # Qwen2 always has biases on q/k/v, never on o_proj, whatever its config says.
    QKV_BIAS = True
    O_BIAS = False
