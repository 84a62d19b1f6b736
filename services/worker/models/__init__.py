"""Model registry: Hugging Face `architectures` name -> our implementation."""
from __future__ import annotations

from torch import nn

from services.worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architectures {architectures}; supported: {sorted(MODEL_REGISTRY)}")
