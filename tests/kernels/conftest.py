"""Fixtures for the kernel checks that run without a GPU: the CPU shim and NVRTC.

Both skip (with the reason printed in pytest's summary) when their tool is missing: g++ for the
shim, the nvidia-cuda-nvrtc-cu12 wheel for NVRTC.
"""
from __future__ import annotations

import pytest
import torch

from services.worker.kernels.nvrtc import find_libnvrtc
from tests.kernels.cuda_shim.build import ShimLauncher, ShimSpec, build_shim, gxx

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def shim_library():
    if gxx() is None:
        pytest.skip("g++ not found: the CPU kernel shim cannot be built")
    return build_shim(ShimSpec.default())


@pytest.fixture
def shim(shim_library) -> ShimLauncher:
    """Fibers in a shuffled order (a missing barrier reads stale shared memory)."""
    return ShimLauncher(shim_library, mode="shuffled")


@pytest.fixture(scope="session")
def nvrtc():
    if find_libnvrtc() is None:
        pytest.skip("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 for the compile check")
