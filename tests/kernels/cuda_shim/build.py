"""Builds the CPU shim library and launches kernels through it with CuPy's calling convention.

`build_shim()` compiles the unmodified .cu sources with g++ after shim.h, plus a generated table
mapping each NVRTC name expression to its template instance, into a shared library cached under
build/cuda_shim/<hash> (the hash covers the sources, every shim file, every kernel header, the
instances, the compiler and the flags, so edits rebuild and nothing else does). `ShimLauncher` runs a `KernelLaunch` on CPU tensors: each tensor is copied
into a buffer with poisoned guard zones (0xFF bytes: NaN as a float, -1 as an int) and the zones
are checked after the launch, so an out-of-bounds read poisons the output and an out-of-bounds
write is reported.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.worker.kernels.launch import KernelLaunch
from services.worker.kernels.loader import MODULES, kernels_dir, read_source

SHIM_DIR = Path(__file__).parent
REPO_ROOT = SHIM_DIR.parents[2]
BUILD_ROOT = Path(os.environ.get("SPINDLE_SHIM_BUILD_DIR", REPO_ROOT / "build" / "cuda_shim"))
FAST_FLAGS = ("-O2",)
TSAN_FLAGS = ("-O1", "-g", "-fsanitize=thread")
MODES = {"fibers": 0, "shuffled": 1, "threads": 2}
GUARD_BYTES = 4096
_CTYPES = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint32: ctypes.c_uint32,
           np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float}


def gxx() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


@dataclass(frozen=True)
class ShimSpec:
    """What goes into one shim library: sources (module -> text) and the instances to export."""

    sources: dict[str, str]  # key: a module of MODULES, or the file name of a test-only kernel
    name_expressions: tuple[str, ...]
    flags: tuple[str, ...] = FAST_FLAGS

    @staticmethod
    def default(modules=tuple(MODULES), flags=FAST_FLAGS) -> "ShimSpec":
        return ShimSpec(
            sources={m: read_source(m) for m in modules},
            name_expressions=tuple(e for m in modules for e in MODULES[m].name_expressions),
            flags=flags,
        )


def _filename(source: str) -> str:
    return MODULES[source].filename if source in MODULES else source


def _launcher_source(spec: ShimSpec, source_dir: Path) -> str:
    lines = ['#include "shim.h"']
    lines += [f'#include "{source_dir / _filename(m)}"' for m in spec.sources]
    lines.append("namespace spindle_shim {")
    lines.append("extern const KernelEntry kKernels[] = {")
    lines += [f'    make_entry("{e}", &{e}),' for e in spec.name_expressions]
    lines.append("};")
    lines.append(f"extern const int kNumKernels = {len(spec.name_expressions)};")
    lines.append("}  // namespace spindle_shim")
    return "\n".join(lines) + "\n"


def build_shim(spec: ShimSpec) -> Path:
    """Compiles (or finds cached) the shim library for `spec`; returns its path."""
    compiler = gxx()
    if compiler is None:
        raise FileNotFoundError("g++ not found: the CPU kernel shim needs a C++17 compiler")
    headers = sorted(kernels_dir().glob("*.cuh"))
    shim_files = sorted(p for p in SHIM_DIR.iterdir() if p.suffix in (".h", ".cpp"))
    digest = hashlib.sha256()
    for part in (
        *(f"{p.name}\n{p.read_text()}" for p in (*shim_files, *headers)),
        repr(sorted(spec.sources.items())),
        repr(spec.name_expressions),
        repr(spec.flags),
        _compiler_version(compiler),
    ):
        digest.update(part.encode())
    out_dir = BUILD_ROOT / digest.hexdigest()[:16]
    library = out_dir / "libspindle_shim.so"
    if library.exists():
        return library
    work = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for header in headers:  # the sources include them from their own folder
        shutil.copy(header, work / header.name)
    for module, text in spec.sources.items():
        (work / _filename(module)).write_text(text)
    (work / "launcher.cpp").write_text(_launcher_source(spec, work))
    cmd = [
        compiler, "-std=c++17", *spec.flags, "-fPIC", "-shared", "-fno-strict-aliasing", "-ftls-model=initial-exec",
        "-Wno-unused-variable", f"-I{SHIM_DIR}", f"-I{work}",
        str(work / "launcher.cpp"), str(SHIM_DIR / "runtime.cpp"), "-o", str(work / library.name), "-lpthread",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"shim build failed:\n{' '.join(cmd)}\n{result.stderr[-6000:]}")
    try:
        work.rename(out_dir)  # atomic: a concurrent build of the same hash just loses the race
    except OSError:
        if not library.exists():  # not a finished rival but a folder left half-written: replace it
            shutil.rmtree(out_dir, ignore_errors=True)
            work.rename(out_dir)
        shutil.rmtree(work, ignore_errors=True)
    return library


@functools.cache
def _compiler_version(compiler: str) -> str:
    """The compiler's own description, so a changed compiler (CXX, an upgrade) rebuilds."""
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return f"{compiler}\n{result.stdout}"


class ShimError(RuntimeError):
    pass


@dataclass
class ShimLauncher:
    """Runs KernelLaunch objects on CPU tensors through a shim library."""

    library: Path
    mode: str = "shuffled"
    seed: int = 0
    launches: list[str] = field(default_factory=list)  # names, in order: tests check the plan

    def __post_init__(self):
        self._lib = ctypes.CDLL(str(self.library))
        self._lib.shim_launch.restype = ctypes.c_int
        self._lib.shim_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]

    def __call__(self, launch: KernelLaunch) -> None:
        self.launches.append(launch.name)
        holders, guarded = [], []
        for arg in launch.args:
            if isinstance(arg, torch.Tensor):
                if arg.device.type != "cpu":
                    raise ValueError("ShimLauncher runs on CPU tensors")
                buffer = _GuardedCopy(arg)
                guarded.append(buffer)
                holders.append(ctypes.c_void_p(buffer.address))
            elif isinstance(arg, np.generic):
                holders.append(_CTYPES[arg.dtype.type](arg.item()))  # the value's exact C type
            else:
                raise TypeError(f"kernel argument {arg!r}: pass a tensor or a numpy scalar")
        argv = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        error = ctypes.create_string_buffer(512)
        self.seed += 1
        rc = self._lib.shim_launch(launch.name.encode(), *launch.grid, *launch.block, argv,
                                   MODES[self.mode], self.seed, error, len(error))
        if rc:
            raise ShimError(error.value.decode())
        for i, buffer in enumerate(guarded):
            buffer.check_and_copy_back(f"{launch.name} argument {i}")


class _GuardedCopy:
    """The bytes a strided tensor spans, between two poisoned guard zones."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        if t.numel() == 0:
            self.span = 0
        else:
            self.span = (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()
        self.raw = np.full(self.span + 2 * GUARD_BYTES, 0xFF, dtype=np.uint8)
        self.address = self.raw.ctypes.data + GUARD_BYTES
        if self.span:
            ctypes.memmove(self.address, t.data_ptr(), self.span)

    def check_and_copy_back(self, what: str) -> None:
        g = GUARD_BYTES
        if (self.raw[:g] != 0xFF).any() or (self.raw[g + self.span :] != 0xFF).any():
            raise ShimError(f"{what}: out-of-bounds write into the guard zone")
        if self.span:
            ctypes.memmove(self.tensor.data_ptr(), self.address, self.span)
