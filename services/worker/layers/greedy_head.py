"""Greedy tokens from a bfloat16 LM head read mostly in int8 (`--cpu-greedy-head-screen`).

A decode step streams every weight once; the tied LM head of SmolLM2-135M is 57 of its 269 MB in
bfloat16. For a step whose rows all take the argmax and nothing else reads the logits (the
sampler's fast path), the logits are computed on an int8 copy of the head (per-row scales, half the
bytes), and csrc/greedy_screen.c computes again from the bfloat16 weight only the tokens whose
logit the int8 error bound leaves in reach of the maximum: the same token as the full head (its
first maximum of the bfloat16 logits), up to the order of the float32 sums. A row whose hidden
state is not finite sends the step to the full head.

The int8 logits come from `AmxInt8Head` (csrc/head_int8_amx.c: hidden rows in 15 bits as two int8
parts, products on AMX-INT8, no widening of the weight) where the CPU has AMX-INT8 and the hidden
size is a multiple of 64 up to 1,024; elsewhere from an `Int8Weight` on the weight-only int8
kernels (int8 GEMV, AMX int8 panels widened to bfloat16, oneDNN), whose activations stay exact.

Without AMX a batch's int8 product costs more than the bfloat16 head it replaces, so the
weight-only copy takes steps of up to `MAX_WEIGHT_ONLY_SCREEN_ROWS` rows (`takes`), where the
int8 GEMV streams half the bytes, and the full head the larger ones. On a 2-core Zen 4
(AVX512_BF16 and VNNI, no AMX; SmolLM2-135M's head, ms for the screen against the full head and
its argmax): 1 row 0.55 / 1.16, 4 rows 1.09 / 1.30, 8 rows 2.06 / 1.46, 20 rows 5.12 / 2.96.
Activations quantized per row on the VNNI column tiles (gemm_int8_tiles.c) left 1,648 tokens a
row in reach on average, so that product is not used here.

Only with bfloat16 weights and no `--quantization` (int8 weights already read the head in int8).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from services.worker.layers.int8_kernels import quantize_per_channel
from services.worker.layers.int8_linear import Int8Weight

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
BOUND_CHUNK_ROWS = 4096  # head rows whose error norms are taken at once, in float64
MAX_AMX_HIDDEN = 1024  # head_int8_amx.c: its combined int32 sums' bound
MAX_WEIGHT_ONLY_SCREEN_ROWS = 4  # without AMX, more rows take the full head (the module docstring)


class AmxInt8Head:
    """The int8 copy packed into AMX-INT8 panels, and its product with 15-bit hidden rows."""

    def __init__(self, library: ctypes.CDLL, qweight: torch.Tensor, scales: torch.Tensor):
        self._gemm = library.head_int8_amx
        self._gemm.argtypes, self._gemm.restype = [_P] * 5 + [_I64] * 3, ctypes.c_int
        pack, nbytes = library.head_int8_amx_pack, library.head_int8_amx_bytes
        pack.argtypes, pack.restype = [_P, _P, _I64, _I64], None
        nbytes.argtypes, nbytes.restype = [_I64, _I64], _I64
        self.vocab, self.hidden = qweight.shape
        self.data = torch.empty(nbytes(self.vocab, self.hidden), dtype=torch.int8)
        pack(qweight.contiguous().data_ptr(), self.data.data_ptr(), self.vocab, self.hidden)
        self.scales = scales.float().contiguous()

    @staticmethod
    def supports(library: ctypes.CDLL, hidden: int) -> bool:
        return bool(library.head_int8_amx_available()) and hidden % 64 == 0 and hidden <= MAX_AMX_HIDDEN

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bfloat16 logits [N, vocab] of the 15-bit rows, float32 [N] |row - its 15-bit row|)."""
        out = torch.empty(hidden.shape[0], self.vocab, dtype=torch.bfloat16)
        x_errors = torch.empty(hidden.shape[0], dtype=torch.float32)
        if self._gemm(hidden.data_ptr(), self.data.data_ptr(), self.scales.data_ptr(), out.data_ptr(),
                      x_errors.data_ptr(), hidden.shape[0], self.vocab, self.hidden):
            raise MemoryError("greedy head screen: no memory for the quantized rows")
        return out, x_errors


class GreedyHeadScreen:
    """The LM head's int8 copy (on AMX-INT8 or the weight-only kernels), its rows' error bounds and
    the bfloat16 weight they are checked on."""

    def __init__(self, library: ctypes.CDLL, weight: torch.Tensor, approx: AmxInt8Head | Int8Weight,
                 bounds: torch.Tensor, weight_norms: torch.Tensor, max_rows: int | None = None):
        self._screen = library.greedy_screen_bf16
        self._screen.argtypes, self._screen.restype = [_P, _I64, _P, _I64] + [_P] * 4 + [_I64] * 3 + [_P, _P], None
        self.weight, self.approx, self.bounds, self.weight_norms = weight, approx, bounds, weight_norms
        self.max_rows = max_rows  # steps with more rows take the full head (None: every step)
        self.num_rows = self.num_candidates = 0  # rows screened and tokens computed again (tests, benchmarks)

    @classmethod
    def build(cls, library: ctypes.CDLL, weight: torch.Tensor,
              make_int8: Callable[[torch.Tensor, torch.Tensor], Int8Weight]) -> GreedyHeadScreen:
        """From the head's bfloat16 `weight` [vocab, hidden] (kept: the screen reads it), its int8
        copy quantized per row: on AMX-INT8 where the library supports the shape, else set on the
        weight-only int8 kernels by `make_int8(qweight, scales)`."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"the greedy head screen takes a bfloat16 [vocab, hidden] weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        weight = weight.detach().contiguous()
        qweight, scales = quantize_per_channel(weight, bfloat16_scales=True)
        bounds, weight_norms = error_bounds(weight, qweight, scales)
        if AmxInt8Head.supports(library, weight.shape[1]):
            return cls(library, weight, AmxInt8Head(library, qweight, scales), bounds, weight_norms)
        approx = make_int8(qweight, scales)
        max_rows = None if approx.amx_weight is not None else MAX_WEIGHT_ONLY_SCREEN_ROWS
        return cls(library, weight, approx, bounds, weight_norms, max_rows)

    @property
    def kernel(self) -> str:
        return "AMX-INT8" if isinstance(self.approx, AmxInt8Head) else "weight-only int8"

    def takes(self, num_rows: int) -> bool:
        """Whether a greedy step of `num_rows` rows is faster through the screen than the full head."""
        return self.max_rows is None or num_rows <= self.max_rows

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """int64 [N]: each row's greedy token for bfloat16 hidden states [N, hidden]; None where a
        row's hidden state is not finite (the full head's logits then decide)."""
        if hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(f"greedy head screen: hidden {hidden.dtype} {tuple(hidden.shape)} against "
                             f"{tuple(self.weight.shape)}")
        hidden = hidden.contiguous()
        num_rows = hidden.shape[0]
        if isinstance(self.approx, AmxInt8Head):
            approx, x_errors = self.approx(hidden)
            x_errors_ptr, norms_ptr = x_errors.data_ptr(), self.weight_norms.data_ptr()
        else:
            approx, x_errors_ptr, norms_ptr = self.approx.linear(hidden), None, None
        tokens = torch.empty(num_rows, dtype=torch.int64)
        counts = torch.empty(num_rows, dtype=torch.int32)
        self._screen(approx.data_ptr(), approx.stride(0), hidden.data_ptr(), hidden.stride(0), self.weight.data_ptr(),
                     self.bounds.data_ptr(), x_errors_ptr, norms_ptr, num_rows, self.weight.shape[0],
                     self.weight.shape[1], tokens.data_ptr(), counts.data_ptr())
        if num_rows and int(tokens.min()) < 0:
            return None
        self.num_rows += num_rows
        self.num_candidates += int(counts.sum())
        return tokens


def error_bounds(weight: torch.Tensor, qweight: torch.Tensor,
                 scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [vocab] each: |w_v - scale_v q_v| + hidden * 2^-22 |w_v| (the second term covers both
    float32 sums' rounding; csrc/greedy_screen.c), and |w_v|; both rounded up."""
    hidden = weight.shape[1]
    bounds = torch.empty(weight.shape[0], dtype=torch.float64)
    norms = torch.empty(weight.shape[0], dtype=torch.float64)
    for start in range(0, weight.shape[0], BOUND_CHUNK_ROWS):
        w = weight[start:start + BOUND_CHUNK_ROWS].double()
        q = qweight[start:start + BOUND_CHUNK_ROWS].double() * scales[start:start + BOUND_CHUNK_ROWS, None].double()
        norms[start:start + len(w)] = w.norm(dim=1)
        bounds[start:start + len(w)] = (w - q).norm(dim=1) + hidden * 2.0**-22 * norms[start:start + len(w)]
    return _rounded_up(bounds), _rounded_up(norms)


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)
