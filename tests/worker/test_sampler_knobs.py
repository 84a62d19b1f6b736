"""The sampler builds tensors only for the knobs a batch uses, and top-k leaves rows without it alone."""
from __future__ import annotations

import torch

from services.common.messages import SamplingParams
from services.worker.sampler import TorchSampler, apply_top_k_top_p
from tests.worker.sampling_batch import metadata_for

VOCAB = 64


def _metadata(params: list[SamplingParams]):
    return metadata_for(params, [None] * len(params), [[1]] * len(params), [[]] * len(params), (2,), VOCAB)


def test_an_all_greedy_batch_builds_no_tensors():
    m = _metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1)])
    assert m.all_greedy
    assert all(t is None for t in (m.is_greedy, m.temperature, m.top_k, m.top_p, m.min_p, m.logit_bias, m.banned,
                                   m.penalties))
    logits = torch.randn(2, VOCAB)
    assert TorchSampler()(logits.clone(), m).sampled_token_ids == logits.argmax(-1).tolist()


def test_only_the_knobs_in_use_get_tensors():
    m = _metadata([SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.0)])
    assert not m.all_greedy and m.is_greedy.tolist() == [False, True]
    assert m.top_p is not None and m.top_k is None and m.min_p is None and m.penalties is None
    m = _metadata([SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=0.5, logit_bias={3: 1.0})])
    assert m.min_p is not None and m.penalties is not None and m.logit_bias is not None and m.top_p is None


def test_top_k_rows_without_top_k_keep_their_whole_vocabulary():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, VOCAB, 5]), None)
    assert torch.isfinite(out[1]).all()
    assert torch.isfinite(out[0]).sum() == 2
    assert set(torch.isfinite(out[2]).nonzero().flatten().tolist()) == set(logits[2].topk(5).indices.tolist())
