"""Greedy tokens from a bfloat16 LM head read mostly in int8 (`--cpu-greedy-head-screen`).

A decode step streams every weight once; the tied LM head of SmolLM2-135M is 57 of its 269 MB in
bfloat16. For a step whose rows all take the argmax and nothing else reads the logits (the
sampler's fast path), the logits are computed on an int8 copy of the head (per-row scales, half the
bytes), and csrc/greedy_screen.c computes again from the bfloat16 weight only the tokens whose
logit the int8 error bound leaves in reach of the maximum: the same token as the full head (its
first maximum of the bfloat16 logits), up to the order of the float32 sums. A row whose hidden
state is not finite sends the step to the full head.

Only with bfloat16 weights and no `--quantization` (int8 weights already read the head in int8).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from services.worker.layers.int8_linear import Int8Weight

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
BOUND_CHUNK_ROWS = 4096  # head rows whose error norms are taken at once, in float64


class GreedyHeadScreen:
    """The LM head's int8 copy, its rows' error bounds and the bfloat16 weight they are checked on."""

    def __init__(self, library: ctypes.CDLL, weight: torch.Tensor, int8: Int8Weight, bounds: torch.Tensor):
        self._screen = library.greedy_screen_bf16
        self._screen.argtypes, self._screen.restype = [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _P, _P], None
        self.weight, self.int8, self.bounds = weight, int8, bounds
        self.num_rows = self.num_candidates = 0  # rows screened and tokens computed again, for the log

    @classmethod
    def build(cls, library: ctypes.CDLL, weight: torch.Tensor,
              make_int8: Callable[[torch.Tensor, torch.Tensor], Int8Weight]) -> GreedyHeadScreen:
        """From the head's bfloat16 `weight` [vocab, hidden] (kept: the screen reads it), its int8
        copy quantized per row and set on its kernels by `make_int8(qweight, scales)`."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"the greedy head screen takes a bfloat16 [vocab, hidden] weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        weight = weight.detach().contiguous()
        qweight, scales = quantize_bf16_scales(weight)
        return cls(library, weight, make_int8(qweight, scales), error_bounds(weight, qweight, scales))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """int64 [N]: each row's greedy token for bfloat16 hidden states [N, hidden]; None where a
        row's hidden state is not finite (the full head's logits then decide)."""
        if hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(f"greedy head screen: hidden {hidden.dtype} {tuple(hidden.shape)} against "
                             f"{tuple(self.weight.shape)}")
        hidden = hidden.contiguous()
        approx = self.int8.linear(hidden)
        num_rows = hidden.shape[0]
        tokens = torch.empty(num_rows, dtype=torch.int64)
        counts = torch.empty(num_rows, dtype=torch.int32)
        self._screen(approx.data_ptr(), approx.stride(0), hidden.data_ptr(), hidden.stride(0), self.weight.data_ptr(),
                     self.bounds.data_ptr(), num_rows, self.weight.shape[0], self.weight.shape[1], tokens.data_ptr(),
                     counts.data_ptr())
        if num_rows and int(tokens.min()) < 0:
            return None
        self.num_rows += num_rows
        self.num_candidates += int(counts.sum())
        return tokens


def quantize_bf16_scales(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 with scales that bfloat16 holds exactly (absmax / 127 rounded up into
    bfloat16): the int8 kernels that take their scales in the activations' dtype (int8pack_mm, the
    widening GEMM) then multiply by the same weight as the float32 ones, which the bounds describe."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    # Up by 2^-8 before rounding to nearest: the rounding moves at most 2^-9, so the scale stays above.
    scales = (torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)) * (1 + 2.0**-8)).bfloat16().float()
    return torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


def error_bounds(weight: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [vocab]: |w_v - scale_v q_v| + hidden * 2^-22 |w_v| per row, rounded up (the second
    term covers both float32 sums' rounding; csrc/greedy_screen.c)."""
    hidden = weight.shape[1]
    bounds = torch.empty(weight.shape[0], dtype=torch.float64)
    for start in range(0, weight.shape[0], BOUND_CHUNK_ROWS):
        w = weight[start:start + BOUND_CHUNK_ROWS].double()
        q = qweight[start:start + BOUND_CHUNK_ROWS].double() * scales[start:start + BOUND_CHUNK_ROWS, None].double()
        bounds[start:start + len(w)] = (w - q).norm(dim=1) + hidden * 2.0**-22 * w.norm(dim=1)
    rounded = bounds.float()
    return torch.where(rounded.double() < bounds, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)
