"""What this test machine's CPU lets PyTorch do, for tests of paths only some CPUs take."""
from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN repacks bfloat16 weights here: PyTorch refuses on CPUs without AVX512BW/VL/DQ
    or AVX-NE-CONVERT (an AVX2-only CPU), where the worker never asks it to (platforms/cpu.py
    prepacks bfloat16 only on a CPU with native bfloat16 arithmetic)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


needs_bf16_packing = pytest.mark.skipif(
    not onednn_packs_bf16(),
    reason="oneDNN packs no bfloat16 weights on this CPU (no AVX512BW/VL/DQ or AVX-NE-CONVERT)")
