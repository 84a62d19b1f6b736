"""Memory for the weights the CPU decode kernels stream every step, on transparent huge pages.

A decode step reads every matmul weight once (270 MB for SmolLM2-135M in bfloat16), panel after
panel. On 4 KiB pages that is a TLB miss every 4 KiB, each a two-level walk under a hypervisor,
and the hardware prefetchers stop at every page edge. On 2 MiB pages SmolLM2-135M's 30 layers'
matmuls on the AMX GEMM ran 13.3 -> 11.8 ms at 40 rows and 9.6 -> 8.7 ms at 16 (a 2-core Sapphire
Rapids VM, docs/benchmarks.md). The packed copies (`AmxGemm.pack`, `Gemv.pack_tiles`) are carved
from arenas mapped once and advised MADV_HUGEPAGE before their first write; where the kernel has
transparent huge pages off, or Python lacks the advice, they are plain `torch.empty` tensors.
"""
from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

WeightAllocator = Callable[[int, torch.dtype], torch.Tensor]  # (numel, dtype) -> a new 1-D tensor
HUGE_PAGE_BYTES = 2 << 20
MIN_ARENA_BYTES = 64 << 20
ALIGN_BYTES = 4096  # each weight starts on its own page: panels begin on a cache line and a page
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def plain_weight_memory(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def transparent_huge_pages_mode(path: Path = THP_MODE_FILE) -> str:
    """The kernel's THP mode (always, madvise or never); 'never' where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


class HugePageArena:
    """Hands out weight tensors from anonymous mappings advised MADV_HUGEPAGE. Weights live as long
    as the worker, so nothing is returned; a mapping stays alive while any tensor on it does."""

    def __init__(self, min_arena_bytes: int = MIN_ARENA_BYTES):
        self.min_arena_bytes = min_arena_bytes
        self._buffer: mmap.mmap | None = None
        self._base = self._offset = self._size = 0  # the aligned region of the current mapping
        self.num_bytes = 0  # handed out, for the log

    @staticmethod
    def available() -> bool:
        return hasattr(mmap, "MADV_HUGEPAGE") and transparent_huge_pages_mode() in ("always", "madvise")

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._buffer is None or self._offset + nbytes > self._size:
            self._map(max(self.min_arena_bytes, nbytes))
        start = self._base + self._offset
        self._offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        self.num_bytes += nbytes
        return torch.frombuffer(self._buffer, dtype=dtype, count=numel, offset=start)

    def _map(self, nbytes: int) -> None:
        size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        buffer = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
        base = -address % HUGE_PAGE_BYTES  # the first 2 MiB boundary: only whole aligned extents go huge
        buffer.madvise(mmap.MADV_HUGEPAGE, 0, len(buffer))
        self._buffer, self._base, self._offset, self._size = buffer, base, 0, size


def weight_allocator(huge_pages: bool) -> WeightAllocator:
    """The allocator for packed decode weights: a huge-page arena where asked for and available."""
    if huge_pages and HugePageArena.available():
        return HugePageArena()
    if huge_pages:
        logger.info("transparent huge pages unavailable (mode %s): packed weights on small pages",
                    transparent_huge_pages_mode())
    return plain_weight_memory
