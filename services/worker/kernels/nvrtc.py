"""Compile check without a GPU: NVRTC through ctypes, ptxas's resource report per kernel.

`cupy.RawModule` needs a driver to compile, but NVRTC itself (the `nvidia-cuda-nvrtc-cu12`
wheel) compiles to a cubin for any architecture on a CPU-only machine, and with
`--ptxas-options=-v` its log says each kernel's registers, shared memory and spills.
`python -m services.worker.kernels.nvrtc [sm_80 sm_90]` prints the table.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from dataclasses import dataclass

from services.worker.kernels.loader import MODULES, NVRTC_OPTIONS, kernels_dir, read_source


@dataclass(frozen=True)
class KernelResources:
    module: str
    name: str  # name expression
    arch: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def find_libnvrtc() -> str | None:
    """libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel (or SPINDLE_NVRTC_LIB), else None."""
    if os.environ.get("SPINDLE_NVRTC_LIB"):
        return os.environ["SPINDLE_NVRTC_LIB"]
    try:
        import nvidia.cuda_nvrtc as wheel
    except ImportError:
        return None
    for folder in wheel.__path__:
        found = sorted(glob.glob(os.path.join(folder, "lib", "libnvrtc.so*")))
        found = [f for f in found if "builtins" not in f and ".alt." not in f]
        if found:
            return found[0]
    return None


class NvrtcError(RuntimeError):
    pass


def _nvrtc() -> ctypes.CDLL:
    path = find_libnvrtc()
    if path is None:
        raise FileNotFoundError("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12")
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(lib, status: int, what: str) -> None:
    if status:
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")


def compile_module(source: str, name_expressions: tuple[str, ...], arch: str,
                   extra_options: tuple[str, ...] = ()) -> tuple[bytes, str, dict[str, str]]:
    """Compiles `source` to a cubin for `arch` (e.g. "sm_90"). Returns (cubin, log,
    name expression -> mangled name). Raises NvrtcError with the log when compilation fails."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
    try:
        for expr in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, expr.encode()), f"name expression {expr}")
        options = [*NVRTC_OPTIONS, f"-I{kernels_dir()}", f"-arch={arch}", "--ptxas-options=-v", *extra_options]
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log_buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log_buf)
        log = log_buf.value.decode(errors="replace")
        if status:
            raise NvrtcError(f"compile for {arch} failed:\n{log}")
        lowered = {}
        for expr in name_expressions:
            name = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(name)), f"lowered name {expr}")
            lowered[expr] = name.value.decode()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw, log, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_FUNCTION = re.compile(r"Compiling entry function '(\S+)'|Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Mangled kernel name -> registers, shared, stack and spill bytes, from a ptxas -v log."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            current = m.group(1) or m.group(2)
            out.setdefault(current, dict(registers=0, shared=0, stack=0, spill_stores=0, spill_loads=0))
        elif current and (m := _STACK.search(line)):
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current and (m := _USED.search(line)):
            out[current].update(registers=int(m.group(1)), shared=int(m.group(2) or 0))
    return out


def module_resources(module: str, arch: str, source: str | None = None, extra_options: tuple[str, ...] = (),
                     name_expressions: tuple[str, ...] | None = None) -> list[KernelResources]:
    """Compiles one module (or some of its instances) for `arch` and reports each instance's
    resources."""
    exprs = name_expressions or MODULES[module].name_expressions
    _, log, lowered = compile_module(source or read_source(module), exprs, arch, extra_options)
    figures = parse_ptxas_log(log)
    rows = []
    for expr, mangled in lowered.items():
        f = figures.get(mangled)
        if f is None:
            raise NvrtcError(f"no ptxas figures for {expr} ({mangled}) in the log:\n{log}")
        rows.append(KernelResources(module, expr, arch, f["registers"], f["shared"], f["stack"],
                                    f["spill_stores"], f["spill_loads"]))
    return rows


def format_table(rows: list[KernelResources]) -> str:
    lines = [f"{'kernel':58} {'arch':6} {'regs':>4} {'smem':>6} {'stack':>5} {'spill st/ld':>11}"]
    for r in rows:
        lines.append(f"{r.name:58} {r.arch:6} {r.registers:4d} {r.shared_bytes:6d} {r.stack_bytes:5d} "
                     f"{r.spill_store_bytes:5d}/{r.spill_load_bytes:<5d}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    archs = argv or ["sm_80", "sm_90"]
    rows = [r for arch in archs for module in MODULES for r in module_resources(module, arch)]
    print(format_table(rows))
    spilled = [r for r in rows if r.spills]
    for r in spilled:
        print(f"SPILL: {r.name} on {r.arch}", file=sys.stderr)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
