"""Every kernel instance compiles through NVRTC for sm_80 and sm_90 with no register spills; the
resource table is printed (pytest -s) and written to build/kernels/nvrtc-resources.txt. The
prefill kernel's PTX shows its products on tensor cores."""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.worker.kernels import nvrtc
from services.worker.kernels.loader import MODULES, NVRTC_OPTIONS, kernels_dir, read_source
from services.worker.kernels.nvrtc import format_table, module_resources

ARCHS = ("sm_80", "sm_90")
REPORT = Path(__file__).parents[2] / "build" / "kernels" / "nvrtc-resources.txt"


@pytest.fixture(scope="module")
def resources(nvrtc):
    # ctypes drops the GIL while NVRTC compiles, so threads use both cores.
    jobs = [(m, a) for a in ARCHS for m in MODULES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: module_resources(*job), jobs))
    rows = [r for result in results for r in result]
    table = format_table(rows)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(table + "\n")
    print("\n" + table)
    return rows


def test_every_instance_compiles_for_every_arch(resources):
    compiled = {(r.name, r.arch) for r in resources}
    expected = {(e, a) for a in ARCHS for m in MODULES.values() for e in m.name_expressions}
    assert compiled == expected


def test_no_kernel_spills(resources):
    spilled = [f"{r.name} on {r.arch}: {r.spill_store_bytes} B stored, {r.spill_load_bytes} B loaded"
               for r in resources if r.spills]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def test_resources_fit_the_launch(resources):
    for r in resources:
        assert r.registers <= 255 and r.shared_bytes <= 48 * 1024, r  # static shared memory limit


def test_the_spill_check_catches_a_spilling_kernel(nvrtc):
    """The check above would fail on a spill: a broken copy of the attention kernel that asks for
    16 resident CTAs (so at most 32 registers a thread) spills, and the report says so."""
    source = read_source("attention")
    bound = "__launch_bounds__(kAttnThreads, AttnMinBlocks<GS>::value)"
    assert bound in source
    broken = source.replace(bound, "__launch_bounds__(kAttnThreads, 16)")
    expr = "spindle::paged_attention<float, 128, 8>"
    rows = module_resources("attention", "sm_90", source=broken, name_expressions=(expr,))
    assert rows[0].spills and rows[0].registers <= 32


def test_the_bitmask_kernel_needs_no_shared_memory_or_stack(resources):
    """apply_token_bitmask only streams bits to stores: a stack frame or shared memory there would
    mean a local array or a reduction crept in."""
    rows = [r for r in resources if r.module == "bitmask"]
    assert {r.arch for r in rows} == set(ARCHS)
    assert all(r.shared_bytes == 0 and r.stack_bytes == 0 for r in rows), rows


def ptx(source: str, name_expression: str, arch: str) -> str:
    """The PTX NVRTC emits for one instance (`compute_*` target: PTX, no cubin)."""
    lib = nvrtc._nvrtc()
    prog = ctypes.c_void_p()
    nvrtc._check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None),
                 "create")
    try:
        nvrtc._check(lib, lib.nvrtcAddNameExpression(prog, name_expression.encode()), name_expression)
        options = [*NVRTC_OPTIONS, f"-I{kernels_dir()}", f"-arch={arch.replace('sm_', 'compute_')}"]
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        nvrtc._check(lib, lib.nvrtcCompileProgram(prog, len(options), argv), "compile")
        size = ctypes.c_size_t()
        nvrtc._check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
        text = ctypes.create_string_buffer(size.value)
        nvrtc._check(lib, lib.nvrtcGetPTX(prog, text), "PTX")
        return text.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# PTX type suffix of an m16n16k16 mma with float accumulators, per input type.
MMA_TYPES = {"spindle::bf16": "f32.bf16.bf16.f32", "spindle::f16": "f32.f32"}


@pytest.mark.parametrize("type_name", MMA_TYPES)
def test_prefill_attention_multiplies_on_tensor_cores(nvrtc, type_name):
    """Q K^T with K^T column-major (row.col) and P V with V row-major (row.row) are wmma.mma.sync
    on the input type with float accumulators, and those are its only mma shapes."""
    text = ptx(read_source("prefill_attention"), f"spindle::prefill_attention<{type_name}, 128>", "sm_80")
    mmas = {line.split()[0] for line in text.splitlines() if "wmma.mma.sync" in line}
    assert mmas == {f"wmma.mma.sync.aligned.{layouts}.m16n16k16.{MMA_TYPES[type_name]}"
                    for layouts in ("row.col", "row.row")}, mmas
    assert "wmma.load.a.sync" in text and "wmma.load.b.sync" in text and "wmma.store.d.sync" in text
