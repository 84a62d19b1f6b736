"""The CPU kernel tests, run on the GPU: the same bodies, with `shim` launching through CuPy on
the device (tests/gpu/conftest.py). Skipped without a device."""
from __future__ import annotations

import pytest

from tests.kernels.test_attention_kernels import *  # noqa: F401,F403
from tests.kernels.test_cupy_backend_on_cpu import *  # noqa: F401,F403
from tests.kernels.test_sampling_distribution import *  # noqa: F401,F403
from tests.kernels.test_sampling_kernels import *  # noqa: F401,F403

pytestmark = pytest.mark.gpu
