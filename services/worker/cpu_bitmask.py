"""The compiled CPU bitmask kernel (csrc/token_bitmask.c): a grammar's allowed tokens applied to
float32 logits in one pass, with a skip for runs of allowed words and stores only for forbidden
ones. The CPU platform's sampler uses it where the library loaded; `apply_token_bitmask_cpu`
(xgrammar's CPU function) is the fallback and the test reference."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class CpuTokenBitmask:
    def __init__(self, library: ctypes.CDLL):
        self._apply = library.apply_token_bitmask_f32
        self._apply.argtypes, self._apply.restype = [_P, _I64, _P, _I64, _P, _I64, _I64], None

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor, row_indices: list[int]) -> None:
        """`Sampler.apply_token_bitmask`'s contract: float32 [N, vocab] logits (rows may be strided),
        a host int32 [N, words] bitmask, the constrained rows."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 \
                or logits.stride(1) != 1:
            raise ValueError("the CPU bitmask kernel takes float32 CPU logits rows with unit stride")
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous() \
                or bitmask.shape[0] != logits.shape[0]:
            raise ValueError("the bitmask must be a contiguous int32 [N, words] tensor, a row per logits row")
        rows = np.asarray(row_indices, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= logits.shape[0]):
            raise ValueError(f"row indices must be in [0, {logits.shape[0]})")
        self._apply(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
                    rows.ctypes.data, len(rows), logits.shape[1])
