"""Building and loading the compiled CPU kernels: cache, prebuilt libraries, fallbacks; a library
that loads also computes decode attention right (against the dense float64 reference)."""
from __future__ import annotations

import torch

from services.worker import cpu_kernels
from services.worker.attention import cpu_decode
from services.worker.attention.cpu_backend import CpuAttentionBackend
from tests.kernels.paged_batch import TOLERANCES, check_batch, make_batch


def _check_decodes(library) -> None:
    """Decodes over scattered blocks of 16 and 32, GQA 8/2, head sizes 64 and 128, both dtypes."""
    backend = CpuAttentionBackend(cpu_decode.PagedDecodeKernel(library))
    for dim, bs, dtype in ((64, 16, torch.float32), (128, 32, torch.bfloat16)):
        batch = make_batch(8, 2, dim, dtype, block_size=bs, requests=[(0, 1), (bs, 1), (3 * bs + 5, 1)], seed=dim)
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                              backend.build_metadata(batch.common), dim**-0.5)
        check_batch(out, batch, dim**-0.5, TOLERANCES[dtype])


def _no_compiler(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)


def test_builds_once_then_reuses_the_cached_library(tmp_path, monkeypatch):
    assert cpu_kernels.load_cpu_kernels(tmp_path) is not None
    libraries = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
    assert len(libraries) == 1
    _no_compiler(monkeypatch)  # a second load must not need the compiler
    library = cpu_kernels.load_cpu_kernels(tmp_path)
    assert library is not None
    kernel = cpu_decode.PagedDecodeKernel(library)
    assert kernel.supports(torch.float32, 64) and kernel.supports(torch.bfloat16, 128)
    assert not kernel.supports(torch.float16, 64)
    assert not kernel.supports(torch.float32, 60) and not kernel.supports(torch.float32, 512)
    _check_decodes(library)  # the cached library, loaded without a compiler


def test_prebuilt_portable_library_loads_without_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("SPINDLE_CPU_KERNEL_MARCH", "x86-64-v3")  # what the CPU image bakes in
    assert cpu_kernels.load_cpu_kernels(tmp_path) is not None
    _no_compiler(monkeypatch)
    library = cpu_kernels.load_cpu_kernels(tmp_path)
    assert library is not None
    _check_decodes(library)


def test_cpu_without_the_target_features_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SPINDLE_CPU_KERNEL_MARCH", "x86-64-v3")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"sse2"})
    assert cpu_kernels.load_cpu_kernels(tmp_path) is None
    assert not (tmp_path / "kernels").exists()


def test_no_compiler_and_no_library_falls_back(tmp_path, monkeypatch):
    _no_compiler(monkeypatch)
    assert cpu_kernels.load_cpu_kernels(tmp_path) is None


def test_failed_build_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert cpu_kernels.load_cpu_kernels(tmp_path) is None
