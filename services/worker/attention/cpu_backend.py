"""CPU attention: the PyTorch backend with decode tokens on the compiled paged-decode kernel.

Prefills and chunks keep PyTorch's SDPA (their queries amortise the gather); decode tokens, where
the gather copy is most of the cost, read the paged cache in place (csrc/paged_decode.c). Use it
only for a cache dtype and head size the kernel `supports`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.torch_backend import DecodeAttention, TorchAttentionBackend


@dataclass(frozen=True)
class CpuDecodeMetadata:
    block_table: torch.Tensor  # [B_d, num_blocks], contiguous
    seq_lens: torch.Tensor  # [B_d]
    max_seq_len: int


class KernelDecode(DecodeAttention[CpuDecodeMetadata]):
    """Decodes on the compiled kernel, which reads K/V through the block table in place."""

    def __init__(self, kernel: PagedDecodeKernel):
        self.kernel = kernel

    def build_metadata(self, block_table, seq_lens, max_seq_len, block_size) -> CpuDecodeMetadata:
        return CpuDecodeMetadata(block_table.contiguous(), seq_lens.contiguous(), max_seq_len)

    def forward(self, query, key_cache, value_cache, metadata: CpuDecodeMetadata, scale) -> torch.Tensor:
        out = self.kernel(query, key_cache, value_cache, metadata.block_table, metadata.seq_lens,
                          metadata.max_seq_len, scale)
        return out.to(query.dtype).reshape(query.shape[0], -1)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel: PagedDecodeKernel):
        super().__init__(KernelDecode(kernel))
