"""The compiled greedy argmax (csrc/argmax.c): each bfloat16 logits row's first maximum, read in
place, for the sampler's all-greedy fast path on the CPU. It gives what `max(dim=-1).indices` gives
on the rows widened to float32, without the widened copy (0.7-0.8 ms a 48-row step there)."""
from __future__ import annotations

import ctypes

import torch

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class CpuGreedyArgmax:
    def __init__(self, library: ctypes.CDLL):
        self._argmax = library.argmax_rows_bf16
        self._argmax.argtypes, self._argmax.restype = [_P, _I64, _I64, _I64, _P], None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [N]: the first maximum of each row of bfloat16 CPU logits [N, vocab] (a NaN counts
        as the maximum), rows with unit stride."""
        if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.dim() != 2 \
                or logits.stride(1) != 1 or logits.shape[1] < 1:
            raise ValueError("the CPU argmax kernel takes bfloat16 CPU logits rows with unit stride")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        if logits.shape[0]:
            self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
        return out
