"""Packed decode weights on transparent huge pages (layers/weight_memory.py): the arena's tensors,
the fallback where the kernel has huge pages off, and the platform handing the arena to the
column tiles and the AMX GEMM, which then multiply exactly as from ordinary memory."""
from __future__ import annotations

import mmap

import pytest
import torch

from services.worker.config import WorkerConfig, config_from_args
from services.worker.layers import weight_memory
from services.worker.layers.amx_gemm import AmxGemm
from services.worker.layers.gemv import Gemv
from services.worker.layers.weight_memory import HugePageArena, plain_weight_memory, weight_allocator
from services.worker.platforms import AttentionHeads, build_platform
from tests.worker.kernel_builds import library_for

needs_thp = pytest.mark.skipif(not HugePageArena.available(),
                               reason="transparent huge pages are off (or unadvisable) on this kernel")


@needs_thp
def test_arena_tensors_are_distinct_page_aligned_and_span_several_mappings():
    arena = HugePageArena(min_arena_bytes=4 << 20)
    tensors = [arena(n, dtype) for n, dtype in ((1000, torch.bfloat16), (3, torch.int8), (1 << 20, torch.float32),
                                                (5, torch.bfloat16))]
    assert [t.numel() for t in tensors] == [1000, 3, 1 << 20, 5]
    assert [t.dtype for t in tensors] == [torch.bfloat16, torch.int8, torch.float32, torch.bfloat16]
    assert all(t.data_ptr() % 4096 == 0 for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert [float(t.float().mean()) for t in tensors] == [1.0, 2.0, 3.0, 4.0]  # no overlap
    # 4 MiB of float32 did not fit the first 4 MiB mapping's remainder: a second mapping, still 2 MiB aligned.
    assert tensors[2].data_ptr() % (2 << 20) == 0
    assert arena.num_bytes == 2000 + 3 + (4 << 20) + 10


@needs_thp
def test_a_large_weight_written_in_the_arena_lies_on_huge_pages():
    arena = HugePageArena()
    weight = arena(8 << 20, torch.bfloat16)  # 16 MiB
    weight.fill_(1.0)
    start, end = weight.data_ptr(), weight.data_ptr() + 16 * 2**20
    huge_kib = 0
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            if "-" in line.split()[0] and len(line.split()[0]) > 9 and ":" not in line.split()[0]:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                inside = low <= start < high or low < end <= high
            elif inside and line.startswith("AnonHugePages:"):
                huge_kib += int(line.split()[1])
    assert huge_kib >= 2048  # at least one 2 MiB page (the kernel may not find them all when memory is short)


def test_without_huge_pages_the_allocator_is_plain_memory(monkeypatch, tmp_path):
    assert weight_allocator(False) is plain_weight_memory
    assert weight_memory.transparent_huge_pages_mode(tmp_path / "missing") == "never"
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(weight_memory, "THP_MODE_FILE", mode)
    assert weight_memory.transparent_huge_pages_mode(mode) == "never"
    monkeypatch.setattr(weight_memory, "transparent_huge_pages_mode", lambda path=mode: "never")
    assert not HugePageArena.available()
    assert weight_allocator(True) is plain_weight_memory
    monkeypatch.setattr(weight_memory, "transparent_huge_pages_mode", lambda path=mode: "madvise")
    assert isinstance(weight_allocator(True), HugePageArena) == hasattr(mmap, "MADV_HUGEPAGE")


def test_the_flag_reaches_the_config_and_the_platform(tmp_path):
    assert config_from_args(["--no-cpu-huge-pages"]).cpu_huge_pages is False
    assert WorkerConfig().cpu_huge_pages is True
    # The torch attention backend: no kernel build, and the weights' memory is chosen all the same.
    off = build_platform(WorkerConfig(cache_dir=str(tmp_path), attention_backend="torch", cpu_huge_pages=False),
                         torch.device("cpu"), torch.bfloat16, AttentionHeads(4, 2, 64))
    assert off.weight_memory is plain_weight_memory
    on = build_platform(WorkerConfig(cache_dir=str(tmp_path), attention_backend="torch"), torch.device("cpu"),
                        torch.bfloat16, AttentionHeads(4, 2, 64))
    assert isinstance(on.weight_memory, HugePageArena) == HugePageArena.available()


@needs_thp
def test_kernels_multiply_arena_weights_as_ordinary_ones(kernel_cache):
    library = library_for("native", kernel_cache)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    arena = HugePageArena()
    gemv = Gemv(library)
    if gemv.has_tiles:
        x = torch.randn(5, 576, generator=gen).to(torch.bfloat16)
        plain, huge = gemv.pack_tiles(weight), gemv.pack_tiles(weight, allocate=arena)
        assert torch.equal(huge.data, plain.data)
        assert torch.equal(gemv.tiles(x, huge), gemv.tiles(x, plain))
    amx = AmxGemm(library)
    if amx.available:
        x = torch.randn(40, 576, generator=gen).to(torch.bfloat16)
        plain, huge = amx.pack(weight, 64), amx.pack(weight, 64, allocate=arena)
        assert torch.equal(huge.data, plain.data)
        assert torch.equal(amx(x, huge), amx(x, plain))
    if not gemv.has_tiles and not amx.available:
        pytest.skip("neither the column tiles nor the AMX GEMM on this CPU")
