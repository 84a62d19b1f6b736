"""What differs between the devices a worker runs on, behind one interface.

A `Platform` is built once per worker (`build_platform`), for the model's dtype and attention
heads, before the model: the model hands its `attention_backend` and `layer_ops` to the layers at
construction, the loader has it repack the weights once they are filled, the worker asks it for
the KV cache budget, and the model runner gets its attention backend and `sampler`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.config import RunnerConfig
from services.worker.kv_cache import KVCacheLayout
from services.worker.layers.layer_ops import LayerOps
from services.worker.sampler import Sampler

if TYPE_CHECKING:
    from services.worker.models.decode_stack import DecodeLayersKernel


@dataclass(frozen=True)
class AttentionHeads:
    """The model's attention geometry, which decides whether a kernel can serve it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, hf_config) -> AttentionHeads:
        num_heads = hf_config.num_attention_heads
        return cls(
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        )


class Platform(abc.ABC):
    """One device kind's attention backend, layer ops, sampler, weight packing and KV cache sizing."""

    name: str  # "cpu" or "cuda"
    device: torch.device
    dtype: torch.dtype  # of the weights and the KV cache
    attention_backend: AttentionBackend
    layer_ops: LayerOps
    sampler: Sampler
    quantization: str = "none"  # of the matmul weights: none, or int8 (CPU)
    # The compiled decoder stack for few-row decode steps (CPU, models/decode_stack.py), or None.
    decode_layers: DecodeLayersKernel | None = None

    @abc.abstractmethod
    def process_weights_after_loading(self, model: nn.Module) -> str:
        """Repacks the loaded weights for this device's matmuls, in place; returns what it did, for
        the load log."""

    @abc.abstractmethod
    def kv_cache_bytes(self, model: nn.Module, layout: KVCacheLayout, config: RunnerConfig) -> int:
        """The bytes the KV cache may take, with the model loaded (the worker turns it into blocks)."""
