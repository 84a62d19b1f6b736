"""The compiled GEMV for weight-only int8 (csrc/gemv_int8.c): decode matmuls of a few rows on the
int8 weight and its per-channel scales, as `Int8Weight` (int8_linear.py) keeps them.

At a few rows a matmul only streams its weight; int8 halves the bytes of bfloat16, but PyTorch's
`_weight_int8pack_mm` reads them well below the memory bandwidth. The GEMV widens int8 to
bfloat16 (by table lookup where the CPU has AVX512_VBMI) and multiplies on AVX512_BF16 dot
products, or widens to float32 for fused multiply-adds (float32 x, CPUs without AVX512_BF16),
each thread streaming its contiguous share of the weight rows once. `Int8Weight.linear` takes it for x of at most `MAX_INT8_GEMV_ROWS` rows.
"""
from __future__ import annotations

import ctypes

import torch

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# Up to this many rows the GEMV beat the PyTorch int8 paths (int8pack_mm, the widening GEMM) on
# every SmolLM2-135M shape by 1.5x or more (2-core Zen 4, weights from memory, bf16 x; 30 layers'
# matmuls at 8 rows about 11 against 27 ms, at 16 rows 18-23 against 35-47 ms; float32 x at 16
# rows 34 against 118 ms). More rows pass over the weight again per 8 of them: at 32 rows the
# margin fell to 1.2x on some shapes and at 64 the widening GEMM won gate_up and the LM head
# (benchmarks/int8_linear_bench.py --suites decode).
MAX_INT8_GEMV_ROWS = 16


class Int8Gemv:
    """y = (x Q^T) * s (+ b) for x [M, K] in bfloat16 or float32, Q [N, K] int8 in [-127, 127]
    contiguous, s [N] float32, b [N] or None; y [M, N] in x's dtype, summed in float32, the scale and
    the bias applied to each sum and the result rounded once."""

    DTYPES = (torch.bfloat16, torch.float32)  # x's, which the output takes

    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, name in zip(self.DTYPES, ("gemv_int8_bf16", "gemv_int8_f32")):
            function = getattr(library, name)
            function.argtypes, function.restype = [_P] * 5 + [_I64] * 3, ctypes.c_int
            self._functions[dtype] = function
        self.has_bf16_dot = bool(library.gemv_int8_has_bf16_dot())  # AVX512_BF16 dot products, else widened

    @staticmethod
    def supports_weight(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether an int8 weight and its scales can be multiplied here; checked once, at loading
        (-128 is outside the widening table; the quantizers clamp to [-127, 127])."""
        plain = qweight.device.type == "cpu" and qweight.dtype == torch.int8 and qweight.dim() == 2
        return (plain and qweight.is_contiguous() and qweight.numel() > 0
                and scales.dtype == torch.float32 and scales.is_contiguous() and scales.shape == qweight.shape[:1]
                and int(qweight.min()) > -128)

    def __call__(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        # Lean on purpose: a decode step makes one call per matmul (121 for SmolLM2-135M), and a
        # few microseconds of Python each add up to a visible share of an 11 ms step.
        function = self._functions.get(x.dtype)
        num_out, num_in = qweight.shape
        if function is None or x.dim() != 2 or x.shape[1] != num_in:
            raise ValueError(f"int8 GEMV: x {x.dtype} {tuple(x.shape)} against an int8 weight {tuple(qweight.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        # The kernel adds a bias in x's dtype to the float32 sums; another one is added after.
        fused_bias = bias is not None and bias.dtype == x.dtype and bias.is_contiguous()
        out = torch.empty(x.shape[0], num_out, dtype=x.dtype)
        status = function(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), bias.data_ptr() if fused_bias else None,
                          out.data_ptr(), x.shape[0], num_out, num_in)
        if status != 0:
            raise MemoryError("int8 GEMV: no memory for its copy of x")
        if bias is not None and not fused_bias:
            out += bias
        return out
