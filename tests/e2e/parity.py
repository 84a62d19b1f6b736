"""Greedy parity with Hugging Face transformers: the correctness oracle.

Token for token against transformers' greedy output. The one allowance is a logit tie: where
transformers' top two logits are within TIE_GAP, float32 rounding in a different (but correct)
summation order may pick the runner-up. Then our token must be exactly that runner-up, and the
comparison goes on against transformers' own continuation of our token, to the last token and the
length. Every tie taken is recorded in TIE_HITS and listed in the test session's summary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

TIE_GAP = 1e-4
# One line per tie taken in this test session (tests/conftest.py prints them at the end).
TIE_HITS: list[str] = []


@dataclass
class Reference:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    step_logits: list[torch.Tensor]  # float32 logits before each generated token
    max_new_tokens: int  # the generation's limit (the output is shorter when it ended on EOS)
    # Transformers' greedy continuation of (prompt + given tokens) for at most n more tokens.
    continue_from: Callable[[list[int], int], "Reference"] | None = None


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
    return Reference(prompt_token_ids, new, [step[0].float() for step in out.logits], max_new_tokens,
                     continue_from=lambda ids, n: hf_greedy(model, ids, n))


def assert_greedy_match(ours: list[int], ref: Reference, label: str) -> None:
    """Token for token, and the same length. At a mismatch, passes on only if transformers' top two
    logits tie within TIE_GAP and our token is its runner-up; then compares the rest against
    transformers' continuation of our token."""
    offset = 0  # ours[offset:] is compared with the current reference
    current = ref
    while True:
        i = _first_difference(ours[offset:], current.output_token_ids)
        if i is None:
            break
        position = offset + i
        top2 = torch.topk(current.step_logits[i], 2)
        gap = float(top2.values[0] - top2.values[1])
        runner_up = int(top2.indices[1])
        if gap >= TIE_GAP or ours[position] != runner_up:
            raise AssertionError(
                f"{label}: token {position} differs: ours {ours[position]} vs HF {current.output_token_ids[i]} "
                f"(top-2 gap {gap:.3e}, HF runner-up {runner_up})\n"
                f"ours: {ours}\nHF:   {ref.output_token_ids[:offset]} + {current.output_token_ids}")
        if current.continue_from is None:
            raise AssertionError(f"{label}: token {position} took a logit tie (gap {gap:.2e}), and the "
                                 "reference cannot continue from our token")
        TIE_HITS.append(f"{label}: token {position} took HF's runner-up {runner_up} on a logit tie "
                        f"(gap {gap:.2e}); compared on against HF's continuation of it")
        offset = position + 1
        prefix = ref.prompt_token_ids + ours[:offset]
        remaining = ref.max_new_tokens - offset
        current = (current.continue_from(prefix, remaining) if remaining > 0
                   else Reference(prefix, [], [], 0, current.continue_from))
    expected_len = offset + len(current.output_token_ids)
    assert len(ours) == expected_len, (
        f"{label}: lengths differ: ours {len(ours)} vs HF {expected_len}\nours: {ours}\n"
        f"HF:   {ref.output_token_ids[:offset]} + {current.output_token_ids}")


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where both have a token and they differ (length is checked apart)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None
