"""The CPU checks fail on a broken prefill_attention: deliberately broken copies of the real
source (a __syncthreads missing between the K/V tile loads and the warps that read them, one
missing before the next tile overwrites them, a __syncwarp missing before lanes read each other's
softmax factors, the chunk's causal offset dropped) are built into their own shim libraries and
each is told apart from the dense reference on the same batch the real kernel passes."""
from __future__ import annotations

import pytest

from tests.kernels.paged_batch import TOLERANCES, check_batch
from tests.kernels.test_broken_kernels import broken_shim
from tests.kernels.test_prefill_attention_kernels import case_batch, run_prefill

CASE = "gqa3-d64-fp16"  # chunks with contexts 45 and 70, two K/V tiles, two query tiles
INSTANCE = "spindle::prefill_attention<spindle::f16, 64>"


@pytest.mark.parametrize("old,new", [
    ("__syncthreads();  // [barrier:kv-loaded]", "// barrier removed"),
    ("__syncthreads();  // [barrier:kv-consumed]", "// barrier removed"),
    ("__syncwarp();  // [barrier:probs]", "// barrier removed"),
    # the chunk's rows taken to start at position 0: fresh prompts stay right, chunks do not
    ("(int)seq_lens[req] - query_len;  // [index:causal-offset]", "0;"),
], ids=("kv-loaded", "kv-consumed", "probs-syncwarp", "causal-offset"))
def test_broken_prefill_kernel_is_caught(shim, old, new):
    batch = case_batch(CASE, seed=1)
    scale = batch.query.shape[2] ** -0.5
    check_batch(run_prefill(shim, batch), batch, scale, TOLERANCES[batch.query.dtype])  # the real kernel
    broken = broken_shim("prefill_attention", old, new, (INSTANCE,))
    with pytest.raises(AssertionError):
        check_batch(run_prefill(broken, batch), batch, scale, TOLERANCES[batch.query.dtype])
