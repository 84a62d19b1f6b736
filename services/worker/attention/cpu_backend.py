"""CPU attention: the PyTorch backend with decode tokens on the compiled paged-decode kernel and,
given one, prefills on the compiled paged-prefill kernel.

Decode tokens, where the gather copy is most of the cost, read the paged cache in place
(csrc/paged_decode.c). Use the backend only for a cache dtype and head size the decode kernel
`supports`. Prefills and chunks take the prefill kernel (csrc/paged_prefill.c: all of a step's
slices in one call, several times SDPA's speed) where it `supports` the cache dtype and heads, and
PyTorch's SDPA otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.cpu_prefill import PagedPrefillKernel, build_prefill_slices
from services.worker.attention.torch_backend import DecodeAttention, TorchAttentionBackend, TorchAttentionMetadata


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

    def __init__(self, kernel: PagedDecodeKernel, prefill_kernel: PagedPrefillKernel | None = None):
        super().__init__(KernelDecode(kernel))
        self.prefill_kernel = prefill_kernel

    def build_metadata(self, common) -> TorchAttentionMetadata:
        metadata = super().build_metadata(common)
        if self.prefill_kernel is None or not metadata.prefills:
            return metadata
        # The kernel's per-slice arrays, once per step: every layer reads the same ones.
        return replace(metadata, prefill=build_prefill_slices(common))

    def attend_prefills(self, query, key, value, key_cache, value_cache, metadata: TorchAttentionMetadata, scale,
                        output) -> None:
        num_heads, num_kv_heads, head_dim = query.shape[1], key_cache.shape[2], key_cache.shape[3]
        if (metadata.prefill is None or query.dtype != key_cache.dtype
                or not self.prefill_kernel.supports(key_cache.dtype, head_dim, num_heads, num_kv_heads)):
            return super().attend_prefills(query, key, value, key_cache, value_cache, metadata, scale, output)
        if query.stride(2) != 1 or query.stride(1) != head_dim:  # the kernel takes any row stride, no other
            query = query.contiguous()
        # This step's K/V are in the cache already (written before `attend`): the kernel reads all
        # keys through the block table, this step's as well.
        self.prefill_kernel(query, key_cache, value_cache, metadata.prefill, output, scale)
