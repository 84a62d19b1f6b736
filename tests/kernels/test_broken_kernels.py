"""The CPU checks fail on broken kernels: deliberately broken copies of the real sources (a
missing barrier, a wrong index, a divergent barrier, an unguarded write) are built into their
own shim libraries and each must be caught. (The spill case is in test_nvrtc_compile.py.)"""
from __future__ import annotations

import pytest
import torch

from services.worker.kernels.cache_ops import reshape_and_cache
from services.worker.kernels.loader import read_source
from tests.kernels.cuda_shim.build import ShimError, ShimLauncher, ShimSpec, build_shim, gxx
from tests.kernels.paged_batch import make_batch, reference_attention
from tests.kernels.test_attention_kernels import run_attention
from tests.kernels.test_bitmask_kernels import run_case
from tests.kernels.test_sampling_kernels import draw

ATTENTION = "spindle::paged_attention<float, 64, 4>"


def broken_shim(module: str, old: str, new: str, names: tuple[str, ...]) -> ShimLauncher:
    if gxx() is None:
        pytest.skip("g++ not found: the CPU kernel shim cannot be built")
    source = read_source(module)
    assert source.count(old) == 1, f"the line to break is gone from {module}: {old!r}"
    spec = ShimSpec({module: source.replace(old, new)}, names, flags=("-O1",))
    modules = {module: spec.sources[module]}
    if module != "cache":  # the attention test writes the cache first
        modules["cache"] = read_source("cache")
        names = names + ("spindle::reshape_and_cache<float>",)
    return ShimLauncher(build_shim(ShimSpec(modules, names, flags=("-O1",))))


def attention_error(shim) -> float:
    batch = make_batch(6, 2, 64, torch.float32, seed=5)
    return float((run_attention(shim, batch, 1).float() - reference_attention(batch, 0.125)).abs().max())


def test_the_unbroken_copy_passes(shim_library):
    assert attention_error(ShimLauncher(shim_library)) < 2e-5


def test_missing_barrier_is_caught():
    shim = broken_shim("attention", "__syncthreads();  // [barrier:scores]", "// barrier removed", (ATTENTION,))
    assert not attention_error(shim) < 1e-2  # stale scores (or NaN from the previous block's garbage)


def test_wrong_index_is_caught():
    shim = broken_shim("attention", "k % block_size;  // [index:slot]", "(k + 1) % block_size;", (ATTENTION,))
    assert not attention_error(shim) < 1e-2


def test_divergent_barrier_is_reported():
    shim = broken_shim("sampling", "__syncthreads();  // [barrier:argmax]",
                       "if (threadIdx.x < 32) __syncthreads();", ("spindle::sample_rows<128>",))
    with pytest.raises(ShimError, match="barrier divergence"):
        draw(shim, torch.randn(2, 50), temperature=0.0)


def test_out_of_bounds_write_is_reported():
    shim = broken_shim("cache", "if (slot < 0) return;", "", ("spindle::reshape_and_cache<float>",))
    batch = make_batch(2, 2, 64, torch.float32, requests=((0, 3),))
    slots = batch.common.slot_mapping.clone()
    slots[0] = -1  # padding, which the broken kernel writes one row before the cache
    with pytest.raises(ShimError, match="out-of-bounds write"):
        shim(reshape_and_cache(batch.kv_cache.clone(), batch.key, batch.value, slots))


@pytest.mark.parametrize("old,new,error,match", [
    ("(t & 31)) & 1u))  // [index:bit]", "((t + 1) & 31)) & 1u))", AssertionError, "differ from xgrammar"),
    ("row_indices[blockIdx.y];  // [index:row]", "blockIdx.y;", AssertionError, "differ from xgrammar"),
    # the last row's tile runs past the end of the logits
    ("if (t < vocab_size && ", "if (", ShimError, "out-of-bounds write"),
], ids=("bit-off-by-one", "row-indices-ignored", "vocab-bound-dropped"))
def test_broken_bitmask_kernel_is_caught(old, new, error, match):
    shim = broken_shim("bitmask", old, new, ("spindle::apply_token_bitmask<256, 4>",))
    with pytest.raises(error, match=match):
        run_case(shim, "1000-subset")
