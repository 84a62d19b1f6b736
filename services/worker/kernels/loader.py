"""The kernel modules, their template instances, and the cached CuPy loader.

Importing this module never compiles anything and never imports CuPy: a module is compiled by
NVRTC (one `cupy.RawModule` with `name_expressions` for every template instance) the first time
one of its kernels is launched, then cached for the life of the process. The same source text
and name expressions feed the NVRTC compile check and the CPU shim in tests.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from services.worker.kernels.launch import CUDA_TYPE_NAMES, KernelLaunch

_TYPES = tuple(CUDA_TYPE_NAMES.values())
HEAD_DIMS = (64, 128)
PREFILL_DTYPES = (torch.bfloat16, torch.float16)
GROUP_TILES = (1, 2, 4, 8)  # query heads per CTA; larger GQA groups are split into tiles of 8
# Threads per row of the sampler: 128 for small vocabularies (tests, tiny models), 512 otherwise.
SAMPLER_THREADS = (128, 512)
SMALL_VOCAB = 8192
# Grammar bitmask: threads per CTA and tokens per thread (a CTA covers 1024 tokens of one row).
BITMASK_THREADS, BITMASK_TOKENS_PER_THREAD = 256, 4

# NVRTC options shared by the loader and the compile check. -default-device: no __host__ code.
NVRTC_OPTIONS = ("-std=c++17", "-default-device", "--use_fast_math")


@dataclass(frozen=True)
class KernelModule:
    filename: str
    name_expressions: tuple[str, ...]


MODULES: dict[str, KernelModule] = {
    "cache": KernelModule("cache.cu", tuple(f"spindle::reshape_and_cache<{t}>" for t in _TYPES)),
    "attention": KernelModule(
        "attention.cu",
        tuple(
            f"spindle::paged_attention<{t}, {d}, {g}>" for t in _TYPES for d in HEAD_DIMS for g in GROUP_TILES
        )
        + tuple(f"spindle::paged_attention_combine<{t}, {d}>" for t in _TYPES for d in HEAD_DIMS),
    ),
    # Tensor cores take 16-bit inputs only: float32 attention stays on paged_attention.
    "prefill_attention": KernelModule(
        "prefill_attention.cu",
        tuple(f"spindle::prefill_attention<{CUDA_TYPE_NAMES[t]}, {d}>" for t in PREFILL_DTYPES for d in HEAD_DIMS),
    ),
    "sampling": KernelModule(
        "sampling.cu",
        ("spindle::apply_sparse_logits<256>", *(f"spindle::sample_rows<{n}>" for n in SAMPLER_THREADS)),
    ),
    "bitmask": KernelModule(
        "bitmask.cu", (f"spindle::apply_token_bitmask<{BITMASK_THREADS}, {BITMASK_TOKENS_PER_THREAD}>",)
    ),
}


def kernels_dir() -> Path:
    """The folder holding the .cu/.cuh package data (a real folder: NVRTC includes from it)."""
    return Path(str(resources.files("services.worker.kernels")))


def read_source(module: str) -> str:
    return (kernels_dir() / MODULES[module].filename).read_text()


@functools.cache
def _raw_module(module: str):
    import cupy

    spec = MODULES[module]
    return cupy.RawModule(
        code=read_source(module),
        options=(*NVRTC_OPTIONS, f"-I{kernels_dir()}"),
        name_expressions=spec.name_expressions,
    )


@functools.cache
def get_function(module: str, name: str):
    """The compiled kernel `name` of `module` (compiles the module on first use)."""
    if name not in MODULES[module].name_expressions:
        raise KeyError(f"{name} is not an instance listed in MODULES[{module!r}]")
    return _raw_module(module).get_function(name)


class CupyLauncher:
    """Launches on the current CUDA device, on PyTorch's current stream, so kernels order with
    PyTorch's own work without synchronising. Tensors travel as their data pointers (an 8-byte
    numpy scalar is exactly what a pointer parameter reads): no copy, no DLPack round trip."""

    def __call__(self, launch: KernelLaunch) -> None:
        args = tuple(_device_arg(a) for a in launch.args)
        kernel = get_function(launch.module, launch.name)
        with _cupy_stream(torch.cuda.current_stream().cuda_stream):
            kernel(launch.grid, launch.block, args)


@functools.cache
def _cupy_stream(handle: int):
    """CuPy's view of a PyTorch stream (cached: one wrapper per stream handle)."""
    import warnings

    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for Stream.from_external,
        warnings.simplefilter("ignore", DeprecationWarning)  # which needs torch's __cuda_stream__
        return cupy.cuda.ExternalStream(handle)


def _device_arg(arg):
    if isinstance(arg, torch.Tensor):
        if not arg.is_cuda:
            raise ValueError("CupyLauncher got a CPU tensor")
        return np.uint64(arg.data_ptr())
    return arg
