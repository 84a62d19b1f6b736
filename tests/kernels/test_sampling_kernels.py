"""The sampling kernels on the CPU shim: the draw bit for bit against a NumPy model of Philox and
the exponential race, kept sets against the PyTorch sampler's top-k/top-p/min-p, the same token
for a seed wherever its row sits, and the sparse logits processors against the PyTorch ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.messages import SamplingParams
from services.worker.cuda_sampler import CudaSampler, _sparse_entries
from services.worker.kernels import sampling_ops
from services.worker.logits_processors import apply_logits_processors
from services.worker.sampler import TorchSampler, apply_min_p, apply_top_k_top_p
from services.worker.sampling_metadata import build_sampling_metadata
from tests.kernels.philox_reference import expected_draw, philox4x32_10


def draw(shim, logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, offsets=None):
    n = logits.shape[0]

    def column(v, dtype):
        return torch.as_tensor(v, dtype=dtype).expand(n).contiguous()

    seeds = torch.arange(n, dtype=torch.int64) if seeds is None else seeds
    offsets = torch.zeros(n, dtype=torch.int64) if offsets is None else offsets
    out = torch.full((n,), -1, dtype=torch.int64)
    shim(sampling_ops.sample_rows(out, logits, column(temperature, torch.float32), column(top_k, torch.int32),
                                  column(top_p, torch.float32), column(min_p, torch.float32), seeds, offsets))
    return out


def test_philox_known_answers():
    """Random123's published Philox4x32-10 test vectors."""
    out = philox4x32_10([[0], [0], [0], [0]], [0, 0])
    assert out[:, 0].tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    assert philox4x32_10([[m]] * 4, [m, m])[:, 0].tolist() == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


@pytest.mark.parametrize("vocab_size", (1000, 20000), ids=("128threads", "512threads"))
def test_draw_matches_the_numpy_model_bit_for_bit(shim, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=gen) * 2
    seeds = torch.tensor([0, 1, -1, 2**40 + 7, -(2**62), 12345], dtype=torch.int64)
    offsets = torch.tensor([0, 5, 2**33 + 1, 0, 9, 1], dtype=torch.int64)
    out = draw(shim, logits, temperature=0.7, seeds=seeds, offsets=offsets)
    for i in range(6):
        kept = np.ones(vocab_size, dtype=bool)
        assert out[i] == expected_draw(logits[i].numpy(), 0.7, kept, int(seeds[i]), int(offsets[i]))


@pytest.mark.parametrize("knob", ("top_k", "top_p", "min_p", "all"))
@pytest.mark.parametrize("vocab_size", (300, 20000))
def test_kept_set_matches_the_torch_sampler(shim, knob, vocab_size):
    """With the kept set from sampler.py's functions, the NumPy model predicts every draw."""
    gen = torch.Generator().manual_seed(7)
    n, temperature = 8, 0.8
    logits = torch.randn(n, vocab_size, generator=gen) * 3
    k = torch.tensor([1, 2, 5, 17, 40, 100, vocab_size - 1, 3])[:n]
    p = torch.tensor([0.05, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.6])
    mp = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9, 0.3])
    use_k, use_p, use_mp = knob in ("top_k", "all"), knob in ("top_p", "all"), knob in ("min_p", "all")
    masked = logits / temperature
    if use_mp:
        masked = apply_min_p(masked, mp)
    masked = apply_top_k_top_p(masked, k if use_k else None, p if use_p else None) if use_k or use_p else masked
    kept = torch.isfinite(masked).numpy()
    seeds = torch.arange(n, dtype=torch.int64) * 1000 + 3
    out = draw(shim, logits, temperature, k.int() if use_k else 0, p if use_p else 1.0, mp if use_mp else 0.0,
               seeds=seeds)
    for i in range(n):
        assert kept[i, out[i]]
        assert out[i] == expected_draw(logits[i].numpy(), temperature, kept[i], int(seeds[i]), 0)


def test_a_seed_draws_the_same_token_wherever_its_row_sits(shim):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 500, generator=gen)
    seeds = torch.tensor([11, 22, 33, 44, 55], dtype=torch.int64)
    offsets = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int64)
    base = draw(shim, logits, 1.5, top_p=0.9, seeds=seeds, offsets=offsets)
    perm = torch.tensor([3, 0, 4, 1, 2])
    moved = draw(shim, logits[perm], 1.5, top_p=0.9, seeds=seeds[perm], offsets=offsets[perm])
    assert moved.tolist() == base[perm].tolist()
    # in a bigger batch, among strangers
    crowd = torch.cat([torch.randn(3, 500, generator=gen), logits[2:3], torch.randn(2, 500, generator=gen)])
    crowd_seeds = torch.tensor([1, 2, 3, 33, 4, 5], dtype=torch.int64)
    crowd_offsets = torch.tensor([0, 0, 0, 2, 0, 0], dtype=torch.int64)
    assert draw(shim, crowd, 1.5, top_p=0.9, seeds=crowd_seeds, offsets=crowd_offsets)[3] == base[2]
    # and the draws do depend on the seed and the step
    assert len(set(draw(shim, logits[:1].expand(16, -1).contiguous(), 5.0).tolist())) > 4


def test_greedy_is_torch_argmax_with_ties_to_the_first(shim):
    logits = torch.randn(4, 20000)
    logits[1, 7] = logits[1, 19000] = 50.0  # a tie: the lower index wins, as in torch.argmax
    logits[2] = 0.0
    out = draw(shim, logits, temperature=0.0)
    assert out.tolist() == logits.argmax(-1).tolist() and out[1] == 7 and out[2] == 0


def test_sparse_processors_match_the_torch_processors(shim):
    vocab_size = 64
    params = [
        SamplingParams(temperature=1.0, logit_bias={3: 5.0, 10: -2.0}),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[9], logit_bias={9: 4.0, 2: 1.0}),
        SamplingParams(temperature=1.0, repetition_penalty=0.8, logit_bias={5: 1.5}),
    ]
    prompts = [[1, 2, 3], [4, 4, 5, 6], [7], [5, 8, 9]]
    outputs = [[3, 3], [5, 6, 6, 6, 11], [], [2, 5]]
    md = build_sampling_metadata(params, [None] * 4, prompts, outputs, (2,), vocab_size, torch.device("cpu"))
    logits = torch.randn(4, vocab_size)
    expected = apply_logits_processors(logits.clone(), md)
    got = logits.clone()
    presence, frequency, repetition = (t.reshape(-1).contiguous() for t in
                                       (md.penalties.presence, md.penalties.frequency, md.penalties.repetition))
    shim(sampling_ops.apply_sparse_logits(got, _sparse_entries(md, 4).to("cpu"), presence, frequency, repetition))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_cuda_sampler_agrees_with_torch_sampler_on_greedy_rows_and_logprobs(shim):
    vocab_size = 100
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, top_k=5, seed=42),
              SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=1.0, top_p=0.5)]
    prompts, outputs = [[1, 2]] * 4, [[3], [4], [5, 5], []]
    logits = torch.randn(4, vocab_size) * 3

    def metadata(seed):
        gens = [None, torch.Generator().manual_seed(seed), None, None]
        return build_sampling_metadata(params, gens, prompts, outputs, (0,), vocab_size, torch.device("cpu"))

    torch_out = TorchSampler()(logits.clone(), metadata(42))
    cuda_out = CudaSampler(shim)(logits.clone(), metadata(42))
    assert cuda_out.sampled_token_ids[0] == torch_out.sampled_token_ids[0]
    assert cuda_out.sampled_token_ids[2] == torch_out.sampled_token_ids[2]
    assert cuda_out.logprobs[0] == torch_out.logprobs[0] and cuda_out.logprobs[1] is None
    top5 = set(logits[1].topk(5).indices.tolist())
    assert cuda_out.sampled_token_ids[1] in top5
    # the seeded row repeats with the same generator state, whatever the other rows drew
    assert CudaSampler(shim)(logits.clone(), metadata(42)).sampled_token_ids[1] == cuda_out.sampled_token_ids[1]
