"""Weight-only int8 matmul kernels: y = x (s * Q)^T with Q int8 [out, in] and s a scale per output
channel, for float32 or bfloat16 rows x; the symmetric per-channel quantizer that makes Q, s, and the
asymmetric one W8A8's tiles take with activation groups (w8a8.py).

Two ways to multiply, chosen per call by `Int8Linear` (int8_linear.py) from the row count:
  - `int8pack_linear`: PyTorch's weight-only int8 GEMM (`aten._weight_int8pack_mm`), which widens
    Q in registers and reads only the int8 bytes: the faster at a few rows, where the matmul is
    bound by reading the weight.
  - `dequantize_chunks_linear`: Q widened to the compute dtype 1024 weight rows at a time (the chunk
    stays in cache for its matmul), multiplied on the platform's ordinary GEMM (oneDNN bf16 where
    the CPU has native bf16, else float32), then scaled per channel; the faster for batches, where
    the GEMM's blocking wins back the cost of widening.
Neither keeps anything but the int8 weight and its scales.
"""
from __future__ import annotations

import torch

# torch 2.13's int8pack_mm crashed (SIGSEGV) on bfloat16 rows starting 2-16 bytes past a 32-byte
# boundary (a view into a larger buffer); the allocator's own tensors start on 64.
INT8PACK_ALIGNMENT_BYTES = 64
WIDEN_CHUNK_ROWS = 1024  # weight rows widened per matmul (1024 x 576 bf16 is 1.2 MB: L2-sized)


def quantize_per_channel(weight: torch.Tensor, bfloat16_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: scale = absmax / 127 of each row, Q = round(W / scale)
    in [-127, 127]. Returns (Q int8 [out, in], scales float32 [out]); an all-zero row gets scale 1.
    `bfloat16_scales`: each scale rounded up to one bfloat16 holds exactly, so kernels that take the
    scales in bfloat16 (int8pack_mm, the widening GEMM) multiply by the same weight as the float32 ones."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    if bfloat16_scales:  # up by 2^-8, then to nearest (which moves at most 2^-9): still >= absmax / 127
        scales = (scales * (1 + 2.0**-8)).bfloat16().float()
    qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return qweight, scales


def quantize_asymmetric(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-output-channel uint8: each row's range, zero included (so the zero point is in
    [0, 255] and a zero weight exact), in 255 steps, W ~ scale (U - zero point). Half a step of
    error, against up to a step twice as wide for absmax / 127 on a lopsided row. Returns (U uint8
    [out, in], zero points int32 [out], scales float32 [out]); an all-zero row gets scale 1."""
    w = weight.detach().float()
    low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scales = torch.where(high > low, (high - low) / 255.0, torch.ones_like(high))
    zero_points = torch.round(-low / scales).clamp_(0, 255)
    u = torch.round(w / scales[:, None]).add_(zero_points[:, None]).clamp_(0, 255).to(torch.uint8)
    return u, zero_points.to(torch.int32), scales


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """s * Q in `dtype` (the float reference of an int8 weight)."""
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def int8pack_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (s * Q)^T by `aten._weight_int8pack_mm`; `scales` must be in x's dtype (the op's rule)."""
    if not x.is_contiguous() or x.data_ptr() % INT8PACK_ALIGNMENT_BYTES:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh allocation is 64-byte aligned
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)


def dequantize_chunks_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                             compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (s * Q)^T by widening Q chunk by chunk into `compute_dtype` (default x's) and multiplying on
    the ordinary GEMM; the result is scaled per channel and returned in x's dtype. int8 values are
    exact in bfloat16, so the only roundings are the GEMM's own and the scaling's."""
    compute_dtype = compute_dtype or x.dtype
    xc = x.to(compute_dtype)
    out = xc.new_empty(x.shape[0], qweight.shape[0])
    for start in range(0, qweight.shape[0], WIDEN_CHUNK_ROWS):
        end = start + WIDEN_CHUNK_ROWS
        torch.mm(xc, qweight[start:end].to(compute_dtype).t(), out=out[:, start:end])
    out *= scales.to(compute_dtype)
    return out.to(x.dtype)


def has_int8pack_mm() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")
