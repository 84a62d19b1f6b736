"""The GPU attention backend's planning and launches, run on the CPU shim against the PyTorch
backend, layer after layer on the same cache (split-K on when the grid would leave most SMs idle)."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.cupy_backend import CupyAttentionBackend
from services.worker.attention.torch_backend import TorchAttentionBackend
from tests.kernels.paged_batch import TOLERANCES, make_batch


@pytest.mark.parametrize("num_sms", (1000, 1), ids=("split", "no-split"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_cupy_backend_matches_torch_backend(shim, dtype, num_sms):
    batch = make_batch(6, 2, 64, dtype, fused_qkv=True, requests=((0, 4), (1, 1), (600, 1), (40, 6)))
    cupy_backend, torch_backend = CupyAttentionBackend(shim, num_sms=num_sms), TorchAttentionBackend()
    cupy_cache, torch_cache = batch.kv_cache.clone(), batch.kv_cache.float().clone()
    for layer in range(2):  # the second call reads what the first wrote
        out = cupy_backend.forward(batch.query, batch.key, batch.value, cupy_cache,
                                   cupy_backend.build_metadata(batch.common), 0.125)
        expected = torch_backend.forward(batch.query.float(), batch.key.float(), batch.value.float(), torch_cache,
                                         torch_backend.build_metadata(batch.common), 0.125)
        torch.testing.assert_close(out.float(), expected, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    combines = [n for n in shim.launches if "combine" in n]
    assert bool(combines) == (num_sms == 1000)  # an idle GPU splits the 600-key context
    assert CupyAttentionBackend.supports(64) and not CupyAttentionBackend.supports(80)
