"""What a kernel wrapper produces and what runs it.

A wrapper validates its tensors and returns a `KernelLaunch`: the module, the NVRTC name
expression, grid, block and the argument tuple in cuLaunchKernel's terms (tensors for pointers,
numpy scalars with the exact C type for values). A launcher runs it: `CupyLauncher` on a GPU
(services.worker.kernels.loader), or the CPU shim in tests (tests/kernels/cuda_shim), with the
very same arguments; so the CPU tests exercise the wrappers' planning too, not only the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# Template type names for each cache / activation dtype (see common.cuh: 16-bit floats are
# uint16 storage, so no CUDA toolkit header is needed).
CUDA_TYPE_NAMES = {torch.float32: "float", torch.bfloat16: "spindle::bf16", torch.float16: "spindle::f16"}


@dataclass(frozen=True)
class KernelLaunch:
    module: str  # key of loader.MODULES
    name: str  # NVRTC name expression, e.g. "spindle::reshape_and_cache<float>"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple  # torch.Tensor (passed as its data pointer) or numpy scalars


class Launcher(Protocol):
    def __call__(self, launch: KernelLaunch) -> None:
        """Runs `launch` on the launcher's device, in order with earlier launches."""


def i32(x: int) -> np.int32:
    return np.int32(x)


def i64(x: int) -> np.int64:
    return np.int64(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


def check_tensor(
    name: str,
    t: torch.Tensor,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    ndim: int | None = None,
    contiguous: bool = True,
    inner_contiguous: bool = False,
    aligned: bool = False,
) -> None:
    """Raises ValueError unless `t` has the dtype and rank the kernel reads it with.

    `inner_contiguous` asks only the last dimensions (all but the first) to be packed, for
    tensors read with a row stride; `aligned` asks 16-byte alignment for vector loads.
    """
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: {t.dim()} dimensions {tuple(t.shape)}, expected {ndim}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if inner_contiguous and t.dim() > 1 and not t[0].is_contiguous():
        raise ValueError(f"{name}: its rows must be contiguous (stride {t.stride()})")
    if aligned:
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: data must be 16-byte aligned for vector loads")
        if t.dim() > 1 and (t.stride(0) * t.element_size()) % 16:
            raise ValueError(f"{name}: row stride must be a multiple of 16 bytes")
