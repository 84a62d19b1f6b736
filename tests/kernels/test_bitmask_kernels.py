"""The grammar bitmask kernel on the CPU shim, against xgrammar's CPU function (TorchSampler's
path) and a NumPy reading of the bits: random masks over vocabularies that end mid-word, subsets
of rows, all-allowed and all-forbidden rows, strided logits; rows not constrained stay the same
bit for bit. Also CudaSampler.apply_token_bitmask, host bitmask in, and the wrapper's checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.cuda_sampler import CudaSampler
from services.worker.kernels.bitmask_ops import apply_token_bitmask
from services.worker.sampler import TorchSampler, apply_token_bitmask_cpu

NEG_INF = float("-inf")


def random_bitmask(num_rows: int, vocab_size: int, seed: int, all_allowed=(), all_forbidden=()) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32 with random bits, padding bits past the vocabulary too
    (a kernel must ignore them); rows listed in `all_allowed` / `all_forbidden` are -1 / 0."""
    num_words = -(-vocab_size // 32)
    gen = np.random.default_rng(seed)
    words = gen.integers(0, 2**32, size=(num_rows, num_words), dtype=np.uint64).astype(np.uint32).view(np.int32)
    bitmask = torch.from_numpy(words.copy())
    bitmask[list(all_allowed)] = -1
    bitmask[list(all_forbidden)] = 0
    return bitmask


def allowed_bits(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[rows, vocab] bool: bit t % 32 of word t // 32, read with NumPy shifts."""
    words = bitmask.numpy().view(np.uint32)
    t = np.arange(vocab_size)
    return ((words[:, t // 32] >> (t % 32).astype(np.uint32)) & 1).astype(bool)


def numpy_reference(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: list[int]) -> torch.Tensor:
    out = logits.clone()
    allowed = allowed_bits(bitmask, logits.shape[1])
    for r in row_indices:
        out[r, torch.from_numpy(~allowed[r])] = NEG_INF
    return out


def run_kernel(shim, logits: torch.Tensor, bitmask: torch.Tensor, row_indices: list[int]) -> None:
    """The launch as CudaSampler makes it: only the constrained rows' words, then the indices."""
    rows = torch.tensor(row_indices, dtype=torch.int32)
    launch = apply_token_bitmask(logits, bitmask[rows.long()].contiguous(), rows)
    if launch is not None:
        shim(launch)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def check_against_references(got: torch.Tensor, logits: torch.Tensor, bitmask: torch.Tensor,
                             row_indices: list[int]) -> None:
    """Raises AssertionError unless `got` is `logits` masked on `row_indices` exactly as xgrammar
    and the NumPy reading say, and every other row is unchanged bit for bit."""
    expected = logits.clone()
    apply_token_bitmask_cpu(expected, bitmask, row_indices)
    assert same_bits(expected, numpy_reference(logits, bitmask, row_indices)), "the two references disagree"
    others = [r for r in range(logits.shape[0]) if r not in row_indices]
    assert same_bits(got[others], logits[others]), "a row not in row_indices changed"
    wrong = (got.view(torch.int32) != expected.view(torch.int32)).nonzero()
    assert not len(wrong), f"masked logits differ from xgrammar's at (row, token) {wrong[:8].tolist()}"


CASES = {  # vocab_size, num_rows, row_indices, all-allowed rows, all-forbidden rows
    "1000-subset": (1000, 6, [0, 2, 3, 5], (2,), (3,)),
    "49152-two": (49152, 4, [1, 3], (), (1,)),
    "20001-all": (20001, 5, [0, 1, 2, 3, 4], (4,), ()),
    "33-last": (33, 3, [2], (), ()),
}


def run_case(shim, case: str) -> None:
    """Masks a case's logits through `shim`; raises AssertionError on any wrong logit."""
    vocab_size, num_rows, row_indices, all_allowed, all_forbidden = CASES[case]
    bitmask = random_bitmask(num_rows, vocab_size, seed=vocab_size, all_allowed=all_allowed,
                             all_forbidden=all_forbidden)
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(vocab_size))
    got = logits.clone()
    run_kernel(shim, got, bitmask, row_indices)
    check_against_references(got, logits, bitmask, row_indices)
    for r in all_allowed:
        assert same_bits(got[r], logits[r])
    for r in all_forbidden:
        assert bool((got[r] == NEG_INF).all())
    # the data exercise something: each random row keeps some tokens and loses others
    for r in set(row_indices) - set(all_allowed) - set(all_forbidden):
        assert 0 < int((got[r] == NEG_INF).sum()) < vocab_size


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_xgrammar_and_the_bits(shim, case):
    run_case(shim, case)


def test_strided_rows_leave_the_padding_alone(shim):
    """Logits as a view of a wider buffer (a row stride past the vocabulary): the columns between
    rows are never written, even where the last word's padding bits say forbidden."""
    vocab_size, width = 1000, 1040
    buffer = torch.randn(4, width, generator=torch.Generator().manual_seed(3))
    bitmask = random_bitmask(4, vocab_size, seed=3)
    bitmask[:, -1] &= 0xFF  # tokens 992..999 as drawn, the padding bits 1000..1023 forbidden
    original = buffer.clone()
    run_kernel(shim, buffer[:, :vocab_size], bitmask, [1, 2])
    check_against_references(buffer[:, :vocab_size], original[:, :vocab_size], bitmask, [1, 2])
    assert same_bits(buffer[:, vocab_size:], original[:, vocab_size:])


def test_cuda_sampler_matches_torch_sampler(shim):
    vocab_size, num_rows = 20001, 5
    bitmask = random_bitmask(num_rows, vocab_size, seed=11, all_forbidden=(4,))
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(11)) * 3
    expected, got = logits.clone(), logits.clone()
    TorchSampler().apply_token_bitmask(expected, bitmask, [1, 2, 4])
    CudaSampler(shim).apply_token_bitmask(got, bitmask, [1, 2, 4])
    assert same_bits(got, expected)
    check_against_references(got, logits, bitmask, [1, 2, 4])
    assert shim.launches == ["spindle::apply_token_bitmask<256, 4>"]


def test_cuda_sampler_without_constrained_rows_launches_nothing(shim):
    logits = torch.randn(3, 100)
    got = logits.clone()
    CudaSampler(shim).apply_token_bitmask(got, random_bitmask(3, 100, seed=1), [])
    assert same_bits(got, logits) and shim.launches == []


def test_cuda_sampler_refuses_rows_out_of_range(shim):
    sampler = CudaSampler(shim)
    for rows in ([3], [-1, 0]):
        with pytest.raises(ValueError, match="out of range"):
            sampler.apply_token_bitmask(torch.randn(3, 100), random_bitmask(3, 100, seed=1), rows)
    with pytest.raises(ValueError, match="host int32"):
        sampler.apply_token_bitmask(torch.randn(3, 100), random_bitmask(3, 100, seed=1).long(), [0])
    assert shim.launches == []


def test_the_wrapper_checks_its_tensors():
    logits = torch.randn(4, 100)
    words = random_bitmask(2, 100, seed=1)
    rows = torch.tensor([0, 3], dtype=torch.int32)
    launch = apply_token_bitmask(logits, words, rows)
    assert launch.grid == (1, 2, 1) and launch.block == (256, 1, 1)
    assert apply_token_bitmask(torch.randn(4, 49152), random_bitmask(2, 49152, seed=1), rows).grid == (48, 2, 1)
    bad = {
        "dtype": (logits.double(), words, rows),
        "rows": (logits, words[:1], rows),
        "cover": (logits, words[:, :3], rows),  # 96 tokens of 100
        "contiguous": (logits, random_bitmask(4, 100, seed=1).T.contiguous().T[:2], rows),
        "index dtype": (logits, words, rows.long()),
        "device": (logits, words.to("meta"), rows),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError):
            apply_token_bitmask(*args)
    assert apply_token_bitmask(logits, words[:0], rows[:0]) is None
