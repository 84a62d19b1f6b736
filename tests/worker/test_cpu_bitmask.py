"""The compiled CPU bitmask kernel against xgrammar's CPU function and a bit-by-bit NumPy reader."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.cpu_bitmask import CpuTokenBitmask
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.sampler import TorchSampler, apply_token_bitmask_cpu


@pytest.fixture(scope="module")
def kernel(kernel_cache):
    library = load_cpu_kernels(kernel_cache)
    if library is None:
        pytest.skip("no C compiler: the CPU bitmask kernel cannot be built here")
    return CpuTokenBitmask(library)


def numpy_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(bitmask.shape[0], -1)
    for row in rows:
        forbidden = bits[row, : logits.shape[1]] == 0
        out[row, torch.from_numpy(forbidden)] = float("-inf")
    return out


@pytest.mark.parametrize("vocab_size", (33, 1000, 49152, 20001))
def test_kernel_matches_xgrammar_and_the_bit_reader(kernel, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    num_rows, num_words = 6, -(-vocab_size // 32)
    logits = torch.randn(num_rows, vocab_size, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, num_words), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # all forbidden
    bitmask[3, : num_words // 2] = 0
    bitmask[3, num_words // 2:] = -1
    rows = [0, 1, 2, 3, 5]  # row 4 is not constrained: left alone whatever its bitmask says
    expected = numpy_reference(logits, bitmask, rows)
    ours = logits.clone()
    kernel(ours, bitmask, rows)
    assert torch.equal(ours, expected)
    theirs = logits.clone()
    apply_token_bitmask_cpu(theirs, bitmask, rows)
    assert torch.equal(theirs, expected)
    assert torch.equal(ours[4], logits[4])


def test_strided_rows_and_the_sampler_hook(kernel):
    logits = torch.randn(4, 96)
    wide = torch.full((4, 128), 7.0)
    wide[:, :96] = logits
    view = wide[:, :96]
    bitmask = torch.zeros(4, 3, dtype=torch.int32)
    bitmask[:, 0] = 0b101
    TorchSampler(kernel).apply_token_bitmask(view, bitmask, [1, 2])
    assert torch.equal(wide[:, 96:], torch.full((4, 32), 7.0))  # between rows: never written
    assert torch.isfinite(view[1]).tolist() == [True, False, True] + [False] * 93
    assert torch.equal(view[0], logits[0])


def test_bad_inputs_are_refused(kernel):
    with pytest.raises(ValueError):
        kernel(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32), [0])
    with pytest.raises(ValueError):
        kernel(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), [0])
    with pytest.raises(ValueError):
        kernel(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2])
