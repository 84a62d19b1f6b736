"""The GPU attention backend's planning and launches, run on the CPU shim against the dense
float64 reference: a mixed step (prefill, chunked prefill, decodes, a 600-key context), then a
decode step that reads the K/V the first step wrote into the cache (split-K on when the grid
would leave most SMs idle)."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.cupy_backend import CupyAttentionBackend
from tests.kernels.paged_batch import TOLERANCES, check_batch, decode_step_after, make_batch

REQUESTS = ((0, 4), (1, 1), (600, 1), (40, 6), (0, 33))


@pytest.mark.parametrize("num_sms", (1000, 1), ids=("split", "no-split"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("heads,head_dim,block_size", [((8, 2), 128, 32), ((6, 2), 64, 16)],
                         ids=("gqa4-d128-bs32", "gqa3-d64-bs16"))
def test_cupy_backend_matches_dense_reference(shim, dtype, num_sms, heads, head_dim, block_size):
    batch = make_batch(*heads, head_dim, dtype, block_size=block_size, fused_qkv=True, requests=REQUESTS,
                       reserve=1)
    backend = CupyAttentionBackend(shim, num_sms=num_sms)
    cache = batch.kv_cache.clone()
    scale = head_dim**-0.5
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build_metadata(batch.common), scale)
    check_batch(out, batch, scale, TOLERANCES[dtype])
    step = decode_step_after(batch)  # reads every key the first step wrote
    out = backend.forward(step.query, step.key, step.value, cache, backend.build_metadata(step.common), scale)
    check_batch(out, step, scale, TOLERANCES[dtype])
    combines = [n for n in shim.launches if "combine" in n]
    assert bool(combines) == (num_sms == 1000)  # an idle GPU splits the 600-key context
    assert CupyAttentionBackend.supports(64) and not CupyAttentionBackend.supports(80)
