"""How the GPU attention backend splits a step between its kernels, on the CPU shim against the
dense float64 reference: 16-bit steps with prefill rows launch prefill_attention for them and
paged_attention for the decode rows (interleaved with the prefills in the batch), float32 and
decode-only steps launch paged_attention alone, and layers after the first reuse the step's plan."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.cupy_backend import CupyAttentionBackend
from tests.kernels.paged_batch import TOLERANCES, check_batch, decode_step_after, make_batch

# Decodes between and after prefills; a chunk continuing mid-block; a 300-key decode context.
MIXED = ((0, 1), (0, 20), (300, 1), (21, 11), (7, 1))


def kernels_launched(shim) -> list[str]:
    names = [n.split("<")[0].removeprefix("spindle::") for n in shim.launches]
    return [n for n in names if n != "reshape_and_cache"]


def forward(backend, batch, cache, metadata=None):
    metadata = metadata or backend.build_metadata(batch.common)
    scale = batch.query.shape[2] ** -0.5
    return backend.forward(batch.query, batch.key, batch.value, cache, metadata, scale), metadata


@pytest.mark.parametrize("dtype,heads,head_dim", [(torch.float16, (8, 1), 128), (torch.bfloat16, (6, 2), 64)],
                         ids=("fp16-gqa8-d128", "bf16-gqa3-d64"))
def test_mixed_step_runs_prefill_and_decode_kernels(shim, dtype, heads, head_dim):
    batch = make_batch(*heads, head_dim, dtype, requests=MIXED, fused_qkv=True, reserve=1, seed=2)
    backend = CupyAttentionBackend(shim, num_sms=1)
    cache = batch.kv_cache.clone()
    out, metadata = forward(backend, batch, cache)
    check_batch(out, batch, head_dim**-0.5, TOLERANCES[dtype])
    assert kernels_launched(shim) == ["prefill_attention", "paged_attention"]
    plan = metadata.mixed_plan(heads[0] // heads[1])
    assert plan.decode is not None and plan.decode.token_ids.tolist() == [0, 21, 33]
    out_again, _ = forward(backend, batch, cache, metadata)  # the next layer: same plan, same output
    assert torch.equal(out_again, out) and metadata.mixed_plan(heads[0] // heads[1]) is plan

    shim.launches.clear()
    step = decode_step_after(batch)
    out, _ = forward(backend, step, cache)
    check_batch(out, step, head_dim**-0.5, TOLERANCES[dtype])
    assert kernels_launched(shim) == ["paged_attention"]


def test_prefill_only_step_launches_no_decode_kernel(shim):
    batch = make_batch(4, 2, 64, torch.bfloat16, requests=((0, 9), (16, 70)), seed=3)
    backend = CupyAttentionBackend(shim, num_sms=1)
    out, metadata = forward(backend, batch, batch.kv_cache.clone())
    check_batch(out, batch, 0.125, TOLERANCES[torch.bfloat16])
    assert kernels_launched(shim) == ["prefill_attention"] and metadata.mixed_plan(2).decode is None


def test_float32_keeps_the_decode_kernel_for_every_row(shim):
    batch = make_batch(6, 2, 64, torch.float32, requests=MIXED, seed=4)
    backend = CupyAttentionBackend(shim, num_sms=1)
    out, _ = forward(backend, batch, batch.kv_cache.clone())
    check_batch(out, batch, 0.125, TOLERANCES[torch.float32])
    assert kernels_launched(shim) == ["paged_attention"]
