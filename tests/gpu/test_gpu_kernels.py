"""The CPU kernel tests, run on the GPU: the same bodies, with `shim` launching through CuPy on
the device (tests/gpu/conftest.py); the WMMA check kernel of tests/kernels/test_shim_wmma.py on
real tensor cores, against the same plain products the shim's emulation must equal. Skipped
without a device."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.worker.cuda_sampler import CudaSampler
from services.worker.kernels.loader import NVRTC_OPTIONS, CupyLauncher, kernels_dir
from services.worker.sampler import apply_token_bitmask_cpu
from tests.gpu.conftest import DeviceLauncher
from tests.kernels.test_attention_kernels import *  # noqa: F401,F403
from tests.kernels.test_bitmask_kernels import *  # noqa: F401,F403
from tests.kernels.test_cupy_backend_on_cpu import *  # noqa: F401,F403
from tests.kernels.test_cupy_backend_prefill import *  # noqa: F401,F403
from tests.kernels.test_prefill_attention_kernels import *  # noqa: F401,F403
from tests.kernels.test_shim_wmma import INSTANCES as WMMA_INSTANCES
from tests.kernels.test_shim_wmma import PRODUCTS as WMMA_PRODUCTS
from tests.kernels.test_shim_wmma import SOURCE as WMMA_SOURCE
from tests.kernels.test_shim_wmma import run_product
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


class WmmaCheckLauncher(DeviceLauncher):
    """DeviceLauncher's copies around the test-only wmma_check.cu, compiled by CuPy as the
    loader compiles the real modules."""

    def __init__(self):
        import cupy

        super().__init__()
        module = cupy.RawModule(code=WMMA_SOURCE.read_text(), options=(*NVRTC_OPTIONS, f"-I{kernels_dir()}"),
                                name_expressions=WMMA_INSTANCES)

        def run(launch):  # on the legacy default stream, as DeviceLauncher's copies
            args = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in launch.args)
            module.get_function(launch.name)(launch.grid, launch.block, args)

        self.cupy = run


@pytest.fixture(scope="module")
def wmma_device():
    return WmmaCheckLauncher()


def test_tensor_cores_compute_the_plain_products_the_shim_emulates(wmma_device):
    for name in WMMA_PRODUCTS:
        got, expected = run_product(wmma_device, name, seed=len(name))
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), name
        assert torch.equal(got.isnan(), expected.isnan()), name


def test_prefill_attention_on_a_long_prompt_against_sdpa():
    """A 1000-token prompt (16 query tiles, 32 K/V tiles) through the backend on the device,
    against torch's scaled_dot_product_attention on the same bf16 inputs."""
    from services.worker.attention.cupy_backend import CupyAttentionBackend
    from tests.kernels.paged_batch import make_batch

    batch = make_batch(8, 2, 128, torch.bfloat16, requests=((0, 1000),), seed=7)
    backend = CupyAttentionBackend(CupyLauncher(), num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    cache = batch.kv_cache.cuda()
    c = batch.common
    metadata = backend.build_metadata(dataclasses.replace(
        c, query_start_loc=c.query_start_loc.cuda(), seq_lens=c.seq_lens.cuda(), slot_mapping=c.slot_mapping.cuda(),
        block_table=c.block_table.cuda()))
    q, k, v = batch.query.cuda(), batch.key.cuda(), batch.value.cuda()
    out = backend.forward(q, k, v, cache, metadata, 128**-0.5).view(1000, 8, 128)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(4, dim=1).transpose(0, 1), v.repeat_interleave(4, dim=1).transpose(0, 1),
        is_causal=True, scale=128**-0.5).transpose(0, 1)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
