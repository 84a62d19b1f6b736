"""Every kernel instance compiles through NVRTC for sm_80 and sm_90 with no register spills; the
resource table is printed (pytest -s) and written to build/kernels/nvrtc-resources.txt."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.worker.kernels.loader import MODULES, read_source
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
