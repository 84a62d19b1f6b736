"""The CPU kernel tests, run on the GPU: the same bodies, with `shim` launching through CuPy on
the device (tests/gpu/conftest.py). Skipped without a device."""
from __future__ import annotations

import pytest
import torch

from services.worker.cuda_sampler import CudaSampler
from services.worker.kernels.loader import CupyLauncher
from services.worker.sampler import apply_token_bitmask_cpu
from tests.kernels.test_attention_kernels import *  # noqa: F401,F403
from tests.kernels.test_bitmask_kernels import *  # noqa: F401,F403
from tests.kernels.test_cupy_backend_on_cpu import *  # noqa: F401,F403
from tests.kernels.test_sampling_distribution import *  # noqa: F401,F403
from tests.kernels.test_sampling_kernels import *  # noqa: F401,F403
from tests.kernels.test_bitmask_kernels import random_bitmask, same_bits

pytestmark = pytest.mark.gpu


def test_cuda_sampler_bitmask_with_logits_on_the_device():
    """The real path, not DeviceLauncher's copies: logits on the GPU, the host bitmask gathered
    into pinned memory and copied without blocking, against xgrammar's CPU function."""
    vocab_size, num_rows, row_indices = 49153, 9, [0, 3, 4, 8]
    bitmask = random_bitmask(num_rows, vocab_size, seed=5, all_allowed=(3,), all_forbidden=(8,))
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(5))
    expected = logits.clone()
    apply_token_bitmask_cpu(expected, bitmask, row_indices)
    got = logits.cuda()
    CudaSampler(CupyLauncher()).apply_token_bitmask(got, bitmask, row_indices)
    assert same_bits(got.cpu(), expected)
