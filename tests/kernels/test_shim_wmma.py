"""The shim's nvcuda::wmma emulation against a plain matrix product, for every fragment layout it
supports: half and bf16 inputs, matrix_a and matrix_b each row- or column-major, the accumulator
loaded or stored in either memory layout (with a leading dimension wider than the matrix) or
filled, two k steps, element-wise work on the accumulator, two warps with their own matrices.
Inputs are multiples of 1/8 that both 16-bit types hold exactly, so every product and sum is
exact in float32 and the results must be equal, not close. The same test kernel compiles through
NVRTC against services/worker/kernels/wmma.cuh, and tests/gpu runs it on a device."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.kernels.launch import KernelLaunch, f32
from services.worker.kernels.nvrtc import module_resources
from tests.kernels.cuda_shim.build import ShimLauncher, ShimSpec, build_shim, gxx

SOURCE = Path(__file__).with_name("wmma_check.cu")
TYPES = {"half": torch.float16, "__nv_bfloat16": torch.bfloat16}
LAYOUTS = ("row_major", "col_major")
LDC = 24  # wmma_check.cu: kLdc
NUM_WARPS = 2


def product_name(type_name: str, layout_a: str, layout_b: str, c_col: int, d_col: int, fill: int) -> str:
    return (f"wmma_check::product<{type_name}, nvcuda::wmma::{layout_a}, nvcuda::wmma::{layout_b}, "
            f"{c_col}, {d_col}, {fill}>")


PRODUCTS = tuple(product_name(t, a, b, c, d, 0)
                 for t, a, b, c, d in itertools.product(TYPES, LAYOUTS, LAYOUTS, (0, 1), (0, 1)))
PRODUCTS += tuple(product_name(t, "row_major", "col_major", 0, 1, 1) for t in TYPES)
INSTANCES = (*PRODUCTS, "wmma_check::fragment_sizes")


@pytest.fixture(scope="module")
def wmma_shim() -> ShimLauncher:
    if gxx() is None:
        pytest.skip("g++ not found: the CPU kernel shim cannot be built")
    return ShimLauncher(build_shim(ShimSpec({SOURCE.name: SOURCE.read_text()}, INSTANCES)))


def _parse(name: str) -> tuple[torch.dtype, bool, bool, bool, bool, bool]:
    args = [a.strip() for a in name[name.index("<") + 1:-1].split(",")]
    return (TYPES[args[0]], args[1].endswith("col_major"), args[2].endswith("col_major"),
            args[3] == "1", args[4] == "1", args[5] == "1")


def _eighths(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-32, 33, shape, generator=generator).double() / 8


def run_product(launcher, name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the kernel stored in D's padded buffers, the expected buffers) for every warp."""
    dtype, a_col, b_col, c_col, d_col, fill = _parse(name)
    gen = torch.Generator().manual_seed(seed)
    a = _eighths(NUM_WARPS, 16, 32, generator=gen)
    b = _eighths(NUM_WARPS, 32, 16, generator=gen)
    c = _eighths(NUM_WARPS, 16, 16, generator=gen)
    c_fill, factor = 0.625, -1.5
    if fill:
        c = torch.full_like(c, c_fill)
    a_mem = (a.transpose(1, 2) if a_col else a).contiguous().to(dtype)  # column-major: [32][16]
    b_mem = (b.transpose(1, 2) if b_col else b).contiguous().to(dtype)  # column-major: [16][32]

    def padded(m: torch.Tensor, col_major: bool) -> torch.Tensor:
        """[W, 16, 16] -> [W, 16, LDC] float32 with the matrix (or its transpose) in front, NaN after."""
        buf = torch.full((NUM_WARPS, 16, LDC), float("nan"))
        buf[:, :, :16] = m.transpose(1, 2) if col_major else m
        return buf

    c_mem = padded(c, c_col)
    d_mem = torch.full((NUM_WARPS, 16, LDC), float("nan"))
    launcher(KernelLaunch(module="wmma_check", name=name, grid=(1, 1, 1), block=(32 * NUM_WARPS, 1, 1),
                          args=(d_mem, a_mem, b_mem, c_mem, f32(c_fill), f32(factor))))
    expected = padded(factor * (a @ b + c), d_col)
    return d_mem, expected


@pytest.mark.parametrize("name", PRODUCTS, ids=lambda n: n[n.index("<") + 1:-1].replace("nvcuda::wmma::", "")
                         .replace(", ", "-"))
def test_wmma_product_equals_the_plain_matrix_product(wmma_shim, name):
    got, expected = run_product(wmma_shim, name, seed=len(name))
    assert torch.equal(got.isnan(), expected.isnan()), "a store wrote outside the matrix or missed a cell"
    assert torch.equal(got.nan_to_num(), expected.nan_to_num()), (got - expected).abs().nan_to_num().max()


def test_fragment_sizes_match_the_gpu(wmma_shim):
    """Elements per lane as on sm_80: half A/B 16 (each element held twice), bf16 A/B 8, float
    accumulator 8."""
    out = torch.zeros(5, dtype=torch.int32)
    wmma_shim(KernelLaunch(module="wmma_check", name="wmma_check::fragment_sizes", grid=(1, 1, 1),
                           block=(32, 1, 1), args=(out,)))
    assert out.tolist() == [16, 16, 8, 8, 8]


def test_threads_mode_gives_the_same_products(wmma_shim):
    """One OS thread per lane with real warp barriers (the mode ThreadSanitizer watches)."""
    threads = ShimLauncher(wmma_shim.library, mode="threads")
    for name in (PRODUCTS[0], PRODUCTS[-1]):
        got, expected = run_product(threads, name)
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_the_check_kernel_compiles_with_nvrtc(nvrtc):
    """The same kernel source against wmma.cuh (the compiler's WMMA intrinsics), every instance."""
    for arch in ("sm_80", "sm_90"):
        rows = module_resources("wmma_check", arch, source=SOURCE.read_text(), name_expressions=INSTANCES)
        assert len(rows) == len(INSTANCES) and not any(r.spills for r in rows)


def test_the_scrambled_mapping_covers_every_cell_once():
    """A property of the emulation that the mma relies on: over the 32 lanes, elements 0..7 of a
    fragment cover the 256 cells of its matrix once, and half's elements 8..15 once more."""
    def cell(salt: int, lane: int, i: int) -> int:  # tests/kernels/cuda_shim/wmma.h: wmma_cell
        index = lane * 8 + i % 8
        return (index * 37 + salt) & 255 if i < 8 else (index * 101 + 3 * salt + 17) & 255

    for salt in (11, 29, 53):
        first = {cell(salt, lane, i) for lane in range(32) for i in range(8)}
        second = {cell(salt, lane, i) for lane in range(32) for i in range(8, 16)}
        assert first == second == set(range(256))
    assert np.unique([cell(11, 0, i) // 16 for i in range(8)]).size > 1  # not the GPU's row-per-lane pairs
