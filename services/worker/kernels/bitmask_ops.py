"""Wrapper for `apply_token_bitmask` (bitmask.cu): a grammar's forbidden tokens to -inf."""
from __future__ import annotations

import torch

from services.worker.kernels.launch import KernelLaunch, check_tensor, i32, i64
from services.worker.kernels.loader import BITMASK_THREADS, BITMASK_TOKENS_PER_THREAD

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: one grid row per constrained logits row
TOKENS_PER_CTA = BITMASK_THREADS * BITMASK_TOKENS_PER_THREAD


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> KernelLaunch | None:
    """Sets to -inf, in place, the tokens of `logits` [N, vocab] float32 (rows may be strided)
    whose bit is 0 in xgrammar's layout (bit t % 32 of word t // 32 set = token t allowed).

    Only the constrained rows travel: `bitmask` [R, >= ceil(vocab / 32)] int32, row j for logits
    row `row_indices[j]` ([R] int32); words past the vocabulary are ignored. All three on one
    device. The indices must lie in [0, N): the kernel writes wherever they point. Returns None
    when no row is constrained."""
    check_tensor("logits", logits, torch.float32, ndim=2, contiguous=False, inner_contiguous=True)
    check_tensor("bitmask", bitmask, torch.int32, ndim=2)
    check_tensor("row_indices", row_indices, torch.int32, ndim=1)
    for name, t in (("bitmask", bitmask), ("row_indices", row_indices)):
        if t.device != logits.device:
            raise ValueError(f"{name}: on {t.device}, logits on {logits.device}")
    vocab_size = logits.shape[1]
    num_rows = row_indices.shape[0]
    if bitmask.shape[0] != num_rows:
        raise ValueError(f"bitmask: {bitmask.shape[0]} rows for {num_rows} row indices")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask: {bitmask.shape[1]} words cover {bitmask.shape[1] * 32} of {vocab_size} tokens")
    if num_rows > MAX_GRID_Y:
        raise ValueError(f"{num_rows} constrained rows, at most {MAX_GRID_Y} in one launch")
    if vocab_size >= 2**31 - TOKENS_PER_CTA:
        raise ValueError("vocabulary too large for int32 token ids")
    if num_rows == 0 or vocab_size == 0:
        return None
    return KernelLaunch(
        module="bitmask",
        name=f"spindle::apply_token_bitmask<{BITMASK_THREADS}, {BITMASK_TOKENS_PER_THREAD}>",
        grid=(-(-vocab_size // TOKENS_PER_CTA), num_rows, 1),
        block=(BITMASK_THREADS, 1, 1),
        args=(logits, i64(logits.stride(0)), bitmask, i64(bitmask.shape[1]), row_indices, i32(vocab_size)),
    )
