"""The agreement check for outputs that may not match float32 token for token (an int8 KV cache,
W8A8 activations): teacher forcing through transformers in float32, every greedy token within the
reference's top k at its position, and at least a given share of them its argmax."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def check_within_reference_top_k(model_dir: Path, prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                                 top_k: int, min_argmax_share: float, num_tokens: int) -> None:
    """`outputs[i]`, the greedy tokens generated after `prompts[i]`, each `num_tokens` long."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    num_checked = num_argmax = 0
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs, strict=True)):
        assert len(tokens) == num_tokens, f"prompt {i}: {len(tokens)} tokens"
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        top = logits.topk(top_k, dim=-1).indices.tolist()
        for j, token in enumerate(tokens):
            rank = int((logits[j] > logits[j, token]).sum())
            assert token in top[j], f"prompt {i} token {j}: {token} not in the reference's top {top_k} (rank {rank})"
        num_argmax += sum(int(t == row[0]) for t, row in zip(tokens, top))
        num_checked += len(tokens)
    assert num_argmax / num_checked >= min_argmax_share, f"{num_argmax} of {num_checked} tokens are the argmax"
