"""The compiled greedy argmax (csrc/argmax.c) against PyTorch's on the rows widened to float32, and
the sampler's all-greedy fast path that takes it: the same tokens, and the float32 path wherever
logprobs or a logits processor need the logits."""
from __future__ import annotations

import pytest
import torch

from services.common.messages import SamplingParams
from services.worker.cpu_argmax import CpuGreedyArgmax
from services.worker.sampler import TorchSampler
from tests.worker.kernel_builds import MARCHES, library_for
from tests.worker.sampling_batch import metadata_for

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module", params=MARCHES)
def argmax(request, kernel_cache):
    """Both builds: this CPU's (16 lanes where it has AVX-512) and the portable one (scalar)."""
    return CpuGreedyArgmax(library_for(request.param, kernel_cache))


def reference(logits: torch.Tensor) -> list[int]:
    return logits.float().max(dim=-1).indices.tolist()


@pytest.mark.parametrize("vocab_size", (1, 7, 16, 33, 1000, 49152, 20001))
def test_random_rows_with_ties_match_pytorch(argmax, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    # Rounded to integers in bfloat16: many tied maxima, so the first one must win.
    logits = (torch.randn(9, vocab_size, generator=gen) * 3).round().to(torch.bfloat16)
    assert argmax(logits).tolist() == reference(logits)


@pytest.mark.parametrize("vocab_size", (5, 40, 49152))
def test_nan_inf_and_signed_zero_rows_match_pytorch(argmax, vocab_size):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, vocab_size, generator=gen).to(torch.bfloat16)
    logits[0] = -INF  # every token -inf: the first
    logits[1, vocab_size // 2] = NAN  # a NaN counts as the maximum
    logits[2, 1::2] = NAN  # the first of several NaNs
    logits[3] = -INF
    logits[3, -1] = 0.0  # the maximum in the tail past the last 16
    logits[4] = -INF
    logits[4, 0], logits[4, -1] = -0.0, 0.0  # equal: the first
    logits[5, :] = INF
    expected = reference(logits)
    assert argmax(logits).tolist() == expected
    assert expected[1] == vocab_size // 2 and expected[2] == 1


def test_strided_rows_and_an_empty_batch(argmax):
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(5, 300, generator=gen).to(torch.bfloat16)
    rows = wide[:, :250]  # rows 300 apart, unit stride within
    assert argmax(rows).tolist() == reference(rows)
    assert argmax(wide[:0]).tolist() == []
    with pytest.raises(ValueError):
        argmax(wide.float())
    with pytest.raises(ValueError):
        argmax(wide.t())


def _sample(sampler: TorchSampler, logits: torch.Tensor, params: list[SamplingParams]):
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    metadata = metadata_for(params, generators, [[1, 2]] * len(params), [[]] * len(params), (2,), logits.shape[1])
    return sampler(logits.clone(), metadata)


def test_sampler_fast_path_gives_the_float32_paths_tokens(argmax):
    calls = []

    def counted(logits):
        calls.append(logits.shape[0])
        return argmax(logits)

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 500, generator=gen) * 2).round().to(torch.bfloat16)
    fast, plain = TorchSampler(greedy_argmax=counted), TorchSampler()
    greedy = [SamplingParams(temperature=0.0)] * 6
    out = _sample(fast, logits, greedy)
    assert calls == [6]
    assert out.sampled_token_ids == _sample(plain, logits, greedy).sampled_token_ids == reference(logits)
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, logprobs=2),  # logprobs read the logits
    SamplingParams(temperature=0.0, logit_bias={7: 100.0}),  # a processor changes them
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
    SamplingParams(temperature=1.0, seed=5),  # a random row
])
def test_sampler_keeps_the_float32_path_where_the_logits_are_read(argmax, params):
    calls = []

    def counted(logits):
        calls.append(logits.shape[0])
        return argmax(logits)

    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    batch = [params, SamplingParams(temperature=0.0)]
    out = _sample(TorchSampler(greedy_argmax=counted), logits, batch)
    assert calls == []
    expected = _sample(TorchSampler(), logits, batch)
    assert out.sampled_token_ids == expected.sampled_token_ids
    if params.logit_bias:
        assert out.sampled_token_ids[0] == 7
