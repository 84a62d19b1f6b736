"""The sampling kernels on the CPU shim: the draw bit for bit against a NumPy model of Philox and
the exponential race; kept sets against the transformers warpers (tests/oracles.py), probed at
both sides of every cut; the same token for a seed wherever its row sits; and the sparse logits
processors against the PyTorch ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.messages import SamplingParams
from services.worker.cuda_sampler import CudaSampler, _sparse_entries
from services.worker.kernels import sampling_ops
from services.worker.logits_processors import apply_logits_processors
from services.worker.sampler import TorchSampler
from tests.kernels.philox_reference import MASK32, expected_draw, gumbel_noise, philox4x32_10
from tests.oracles import RowKnobs, reference_kept
from tests.worker.sampling_batch import metadata_for


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


K = RowKnobs
# Per-row knobs, off values among them (top_k 0 or -1; top_p 1; min_p 0). Cuts are kept where the
# weakest kept token is not too rare, so the boundary probes below find their offsets quickly.
KERNEL_BATCHES = {
    "top_k": [K(0.8, 1), K(1.0, 5), K(1.3, 40), K(1.0, 0), K(0.9, 60), K(2.0, -1), K(1.0, 2), K(0.7, 17)],
    "top_p": [K(0.7, top_p=0.5), K(1.0, top_p=0.6), K(1.0), K(0.8, top_p=0.05), K(1.2, top_p=0.4),
              K(1.0, top_p=0.3), K(0.6, top_p=0.9), K(0.9, top_p=0.7)],
    "min_p": [K(1.0, min_p=0.1), K(0.7, min_p=0.01), K(1.5, min_p=0.5), K(1.0), K(2.0, min_p=0.05),
              K(1.0, min_p=0.9), K(0.9, min_p=0.02), K(1.2, min_p=0.2)],
    "all": [K(1.3, 50, 0.9, 0.05), K(0.8, 0, 0.6, 0.0), K(0.5, 20, 1.0, 0.1), K(2.0, 0, 0.3, 0.02),
            K(1.0, 7, 0.8, 0.0), K(1.5, 0, 1.0, 0.3), K(1.1, 3, 0.05, 0.0), K(1.0, 100, 0.97, 0.01)],
}


def _gumbel(seed: int, offsets: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """gumbel_noise for many offsets at a few tokens: [len(offsets), len(tokens)]."""
    n_off, n_tok = len(offsets), len(tokens)
    groups = np.tile((tokens // 4).astype(np.uint64), n_off)
    offs = np.repeat(offsets.astype(np.uint64), n_tok)
    words = philox4x32_10([groups, offs & np.uint64(MASK32), offs >> np.uint64(32), np.zeros_like(groups)],
                          [seed & MASK32, seed >> 32])
    bits = words[np.tile(tokens % 4, n_off), np.arange(len(groups))]
    u = ((bits >> 8).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    with np.errstate(divide="ignore"):  # u rounds to 1 for the top bit patterns: +inf, as in the model
        return (-np.log(-np.log(u))).reshape(n_off, n_tok)


def _offset_where_wins(row: np.ndarray, temperature: float, candidates: np.ndarray, target: int, seed: int) -> int:
    """The first offset whose draw among `candidates` is `target`."""
    keys_base = row[candidates].astype(np.float32) * (np.float32(1.0) / np.float32(temperature))
    for start in range(0, 16384, 512):
        offsets = np.arange(start, start + 512)
        wins = candidates[np.argmax(keys_base + _gumbel(seed, offsets, candidates), axis=1)] == target
        if wins.any():
            return int(offsets[np.argmax(wins)])
    raise AssertionError(f"no offset below 16384 draws token {target}: pick other test data")


def probe_plan(logits: torch.Tensor, knobs, kept: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, seed, offset) draws: two plain ones per row, plus where the row cuts, one whose draw is
    the weakest kept token and one that would draw the strongest cut token if it were kept. A
    filter's kept set is a top slice of the row's order, so any other set misses one of the two."""
    plan = []
    for i, k in enumerate(knobs):
        seed = 1000 * i + 3
        plan += [(i, seed, 0), (i, seed, 1)]
        row, keep = logits[i].numpy(), kept[i].numpy()
        if keep.all():
            continue
        inside, outside = np.flatnonzero(keep), np.flatnonzero(~keep)
        weakest, strongest_cut = inside[np.argmin(row[inside])], outside[np.argmax(row[outside])]
        off_in = _offset_where_wins(row, k.temperature, inside, weakest, seed)
        assert expected_draw(row, k.temperature, keep, seed, off_in) == weakest
        wider = keep.copy()
        wider[strongest_cut] = True
        off_out = _offset_where_wins(row, k.temperature, np.flatnonzero(wider), strongest_cut, seed)
        assert expected_draw(row, k.temperature, wider, seed, off_out) == strongest_cut
        plan += [(i, seed, off_in), (i, seed, off_out)]
    return plan


def draw_plan(shim, logits, knobs, plan) -> list[int]:
    rows = [r for r, _, _ in plan]

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype)

    out = torch.full((len(plan),), -1, dtype=torch.int64)
    shim(sampling_ops.sample_rows(
        out, logits[rows].contiguous(), column([knobs[r].temperature for r in rows], torch.float32),
        column([knobs[r].top_k for r in rows], torch.int32), column([knobs[r].top_p for r in rows], torch.float32),
        column([knobs[r].min_p for r in rows], torch.float32), column([s for _, s, _ in plan], torch.int64),
        column([o for _, _, o in plan], torch.int64)))
    return out.tolist()


def check_draws(draws, logits, knobs, kept, plan) -> None:
    """Raises AssertionError unless every draw is the NumPy model's draw over the `kept` set."""
    wrong = [(r, o, d, expected_draw(logits[r].numpy(), knobs[r].temperature, kept[r].numpy(), s, o))
             for d, (r, s, o) in zip(draws, plan)]
    wrong = [w for w in wrong if w[2] != w[3]]
    assert not wrong, "draws off the kept set (row, offset, drew, expected): " + str(wrong[:8])


def _is_off(k: RowKnobs, vocab_size: int) -> bool:
    return not (0 < k.top_k < vocab_size) and k.top_p >= 1 and k.min_p <= 0


@pytest.mark.parametrize("batch", KERNEL_BATCHES)
@pytest.mark.parametrize("vocab_size", (3000, 20000), ids=("128threads", "512threads"))
def test_kept_set_matches_the_transformers_warpers(shim, batch, vocab_size):
    """The kernel keeps exactly the warpers' set (vLLM's order: temperature, min-p, top-k, top-p):
    the NumPy model over that set predicts every draw, boundary probes included."""
    knobs = KERNEL_BATCHES[batch]
    logits = torch.randn(len(knobs), vocab_size, generator=torch.Generator().manual_seed(vocab_size)) * 3
    kept = reference_kept(logits, knobs)
    plan = probe_plan(logits, knobs, kept)
    draws = draw_plan(shim, logits, knobs, plan)
    check_draws(draws, logits, knobs, kept, plan)
    # the data exercise something: every row with a knob on cuts, the others keep every token
    assert [bool(row.all()) for row in kept] == [_is_off(k, vocab_size) for k in knobs]


def test_the_probes_tell_a_set_one_token_off_apart(shim):
    """The same draws, checked against a set one token short or one token long at the cut, fail."""
    knobs = KERNEL_BATCHES["all"]
    logits = torch.randn(len(knobs), 3000, generator=torch.Generator().manual_seed(2)) * 3
    kept = reference_kept(logits, knobs)
    plan = probe_plan(logits, knobs, kept)
    draws = draw_plan(shim, logits, knobs, plan)
    check_draws(draws, logits, knobs, kept, plan)
    for row in range(len(knobs)):  # each cutting row, its set one token short, then one long
        if kept[row].all():
            continue
        short, long = kept.clone(), kept.clone()
        short[row, logits[row].masked_fill(~kept[row], float("inf")).argmin()] = False  # weakest kept
        long[row, logits[row].masked_fill(kept[row], float("-inf")).argmax()] = True  # strongest cut
        for wrong in (short, long):
            with pytest.raises(AssertionError, match="draws off the kept set"):
                check_draws(draws, logits, knobs, wrong, plan)


def test_noise_model_for_many_offsets_is_gumbel_noise():
    tokens = np.array([0, 5, 6, 7, 998, 2999])
    many = _gumbel(77, np.array([0, 3, 2**33 + 1]), tokens)
    for j, offset in enumerate((0, 3, 2**33 + 1)):
        assert np.array_equal(many[j], gumbel_noise(77, offset, 3000)[tokens])


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
    md = metadata_for(params, [None] * 4, prompts, outputs, (2,), vocab_size)
    logits = torch.randn(4, vocab_size)
    expected = apply_logits_processors(logits.clone(), md)
    got = logits.clone()
    presence, frequency, repetition = (t.reshape(-1).contiguous() for t in
                                       (md.penalties.presence, md.penalties.frequency, md.penalties.repetition))
    shim(sampling_ops.apply_sparse_logits(got, _sparse_entries(md).to("cpu"), presence, frequency, repetition))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_cuda_sampler_agrees_with_torch_sampler_on_greedy_rows_and_logprobs(shim):
    vocab_size = 100
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, top_k=5, seed=42),
              SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=1.0, top_p=0.5)]
    prompts, outputs = [[1, 2]] * 4, [[3], [4], [5, 5], []]
    logits = torch.randn(4, vocab_size) * 3

    def metadata(seed):
        gens = [None, torch.Generator().manual_seed(seed), None, None]
        return metadata_for(params, gens, prompts, outputs, (0,), vocab_size)

    torch_out = TorchSampler()(logits.clone(), metadata(42))
    cuda_out = CudaSampler(shim)(logits.clone(), metadata(42))
    assert cuda_out.sampled_token_ids[0] == torch_out.sampled_token_ids[0]
    assert cuda_out.sampled_token_ids[2] == torch_out.sampled_token_ids[2]
    assert cuda_out.logprobs[0] == torch_out.logprobs[0] and cuda_out.logprobs[1] is None
    top5 = set(logits[1].topk(5).indices.tolist())
    assert cuda_out.sampled_token_ids[1] in top5
    # the seeded row repeats with the same generator state, whatever the other rows drew
    assert CudaSampler(shim)(logits.clone(), metadata(42)).sampled_token_ids[1] == cuda_out.sampled_token_ids[1]
