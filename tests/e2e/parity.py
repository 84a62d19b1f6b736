"""Greedy parity with Hugging Face transformers: the correctness oracle."""
from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_GAP = 1e-4


@dataclass
class Reference:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    step_logits: list[torch.Tensor]  # float32 logits before each generated token


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> Reference:
    input_ids = torch.tensor([prompt_token_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.generation_config.eos_token_id
            if isinstance(model.generation_config.eos_token_id, int) else 0,
        )
    new = out.sequences[0, len(prompt_token_ids):].tolist()
    return Reference(prompt_token_ids, new, [step[0].float() for step in out.logits])


def assert_greedy_match(ours: list[int], ref: Reference, label: str) -> None:
    """Token for token; at a mismatch, passes only if HF's top two logits tie within TIE_GAP (printed)."""
    n = min(len(ours), len(ref.output_token_ids))
    for i in range(n):
        if ours[i] == ref.output_token_ids[i]:
            continue
        top2 = torch.topk(ref.step_logits[i], 2).values
        gap = float(top2[0] - top2[1])
        if gap < TIE_GAP:
            print(f"{label}: token {i} differs on a logit tie (gap {gap:.2e}); comparison stops here")
            return
        raise AssertionError(
            f"{label}: token {i} differs: ours {ours[i]} vs HF {ref.output_token_ids[i]} (top-2 gap {gap:.3e})\n"
            f"ours: {ours}\nHF:   {ref.output_token_ids}"
        )
    assert len(ours) == len(ref.output_token_ids), (
        f"{label}: lengths differ: ours {len(ours)} vs HF {len(ref.output_token_ids)}\nours: {ours}\n"
        f"HF:   {ref.output_token_ids}"
    )
