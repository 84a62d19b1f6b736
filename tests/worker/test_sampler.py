from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.common.messages import SamplingParams
from services.worker import logits_processors
from services.worker.logits_processors import apply_logits_processors
from services.worker.sampler import TorchSampler, apply_top_k_top_p
from tests.worker.sampling_batch import metadata_for

VOCAB = 64


def _sample(logits: torch.Tensor, params: list[SamplingParams], outputs=None, prompts=None, eos=(2,)):
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    outputs = outputs or [[] for _ in params]
    prompts = prompts or [[] for _ in params]
    metadata = metadata_for(params, generators, prompts, outputs, eos, VOCAB)
    return TorchSampler()(logits.clone(), metadata)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_fast_path_and_temperature_zero():
    logits = _logits(4)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 4)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    logits = torch.zeros(3, VOCAB)
    logits[0, [5, 9, 40]] = 2.0  # three tied maxima
    logits[1, :] = 1.0  # every token tied
    logits[2, [3, 60]] = 7.5
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 3)
    assert out.sampled_token_ids == [5, 0, 3] == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy_even_at_high_temperature():
    logits = _logits(3)
    params = [SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0), SamplingParams(temperature=0)]
    out = _sample(logits, params)
    greedy = logits.argmax(-1).tolist()
    assert out.sampled_token_ids[0] == greedy[0] and out.sampled_token_ids[2] == greedy[2]


def test_seed_gives_same_tokens_wherever_the_row_sits():
    target = _logits(1, seed=5)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [_sample(target, [seeded]).sampled_token_ids[0] for _ in range(3)]
    assert len(set(alone)) == 1  # fresh generator each time: same draw
    others = _logits(5, seed=9)
    for position in range(6):
        logits = torch.cat([others[:position], target, others[position:]])
        params = [SamplingParams(temperature=0.7)] * 6
        params[position] = seeded
        assert _sample(logits, params).sampled_token_ids[position] == alone[0]


def test_seeded_draws_follow_the_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)] + [-1e9] * (VOCAB - 2)])
    generator = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0, seed=0)]
    metadata = metadata_for(params, [generator], [[]], [[]], (), VOCAB)
    counts = [0, 0]
    for _ in range(2000):
        counts[TorchSampler()(logits.clone(), metadata).sampled_token_ids[0]] += 1
    assert 0.70 < counts[1] / 2000 < 0.80  # p = 0.75


def test_top_k_top_p_and_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.85, top_k=3), {0, 1, 2}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),
    ]:
        seen = {_sample(logits, [SamplingParams(**{**vars(params), "seed": s})]).sampled_token_ids[0]
                for s in range(200)}
        assert seen == allowed, params


def test_apply_top_k_top_p_mixed_rows():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[1]).all()


def test_logprobs_rank_and_top_alternatives():
    logits = _logits(2)
    out = _sample(logits, [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)])
    expected = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.rank == 1 and lp.logprob == pytest.approx(expected.max().item(), abs=1e-5)
    assert [t for t, _ in lp.top_logprobs] == expected.topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_min_tokens_bans_eos_and_logit_bias():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # EOS most likely
    assert _sample(logits, [SamplingParams(temperature=0.0, min_tokens=2)], outputs=[[7]]).sampled_token_ids[0] != 2
    assert _sample(logits, [SamplingParams(temperature=0.0, min_tokens=2)], outputs=[[7, 8]]).sampled_token_ids[0] == 2
    biased = SamplingParams(temperature=0.0, logit_bias={5: 20.0})
    assert _sample(logits, [biased]).sampled_token_ids[0] == 5


def test_penalties_push_greedy_away_from_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, :3] = torch.tensor([2.0, 1.9, 1.8])
    plain = SamplingParams(temperature=0.0)
    assert _sample(logits, [plain], outputs=[[0, 0]]).sampled_token_ids == [0]
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    assert _sample(logits, [frequency], outputs=[[0]]).sampled_token_ids == [0]  # 2.0 - 0.1 > 1.9 - 0
    assert _sample(logits, [frequency], outputs=[[0, 0]]).sampled_token_ids == [1]  # 1.8 < 1.9
    presence = SamplingParams(temperature=0.0, presence_penalty=0.15)
    assert _sample(logits, [presence], outputs=[[0, 0, 0]]).sampled_token_ids == [1]
    # repetition counts the prompt too: 2.0 / 1.2 and 1.9 / 1.2 fall below 1.8
    repetition = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert _sample(logits, [repetition], prompts=[[0]], outputs=[[1]]).sampled_token_ids == [2]


def dense_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts, outputs) -> torch.Tensor:
    """The penalties as dense [N, vocab] arithmetic, request by request from the lists."""
    counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        for token in output:
            counts[row, token] += 1
        seen[row, prompt] = True
    seen |= counts > 0

    def factor(name):
        return torch.tensor([[getattr(p, name)] for p in params], dtype=torch.float32)

    repetition = torch.where(seen, factor("repetition_penalty").expand_as(logits), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    return logits - factor("frequency_penalty") * counts - factor("presence_penalty") * (counts > 0).float()


PENALISED = [SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
             SamplingParams(temperature=1.0),  # no penalty: left alone
             SamplingParams(temperature=0.7, repetition_penalty=0.8, seed=3),
             SamplingParams(temperature=0.0, frequency_penalty=-0.4, presence_penalty=-1.0)]
PENALISED_PROMPTS = [[1, 2, 3, 3], [4, 5], [7, 7, 60], [9]]
PENALISED_OUTPUTS = [[3, 3, 5, 11, 11, 11], [4, 6], [], [9, 9, 63, 0]]


def test_penalties_change_only_seen_tokens_as_the_dense_formula_does():
    logits = _logits(len(PENALISED), seed=4)
    metadata = metadata_for(PENALISED, [None] * 4, PENALISED_PROMPTS, PENALISED_OUTPUTS, (), VOCAB)
    got = apply_logits_processors(logits.clone(), metadata)
    expected = dense_penalties(logits, PENALISED, PENALISED_PROMPTS, PENALISED_OUTPUTS)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bit for bit
    assert torch.equal(got[1], logits[1]) and not torch.equal(got[0], logits[0])


def test_penalties_that_forget_the_prompt_differ_from_the_dense_formula(monkeypatch):
    original = logits_processors.merge_entries

    def without_prompt(penalty_tokens):
        rows, prompt, output = penalty_tokens
        return original(penalty_tokens=(rows, np.full_like(prompt, -1), output))

    monkeypatch.setattr(logits_processors, "merge_entries", without_prompt)
    logits = _logits(len(PENALISED), seed=4)
    metadata = metadata_for(PENALISED, [None] * 4, PENALISED_PROMPTS, PENALISED_OUTPUTS, (), VOCAB)
    got = apply_logits_processors(logits.clone(), metadata)
    assert not torch.equal(got, dense_penalties(logits, PENALISED, PENALISED_PROMPTS, PENALISED_OUTPUTS))
