"""CPU attention over the int8 KV cache (`--kv-cache-dtype int8`, attention/int8_kv_cache.py).

Decode tokens, whose attention is bound by the cache bytes it reads, run on the compiled int8
decode kernel (csrc/paged_decode_int8.c), which reads the int8 rows, their scales and midpoints
in place: a little over half of bfloat16's bytes. Prefills, whose attention is bound by arithmetic, dequantize the blocks
their slices read once per layer (the compiled dequantizer, csrc/kv_int8.c) into a dense cache in
the model's dtype and attend there, on the compiled prefill kernel where it serves the dtype and
on SDPA otherwise, through block tables remapped once per step. Every query reads keys and values
as the cache holds them, this step's too, so prefill and decode see the same values whichever
kernel runs. Keys and values are written by the compiled int8 writer.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cpu_decode_int8 import PagedDecodeInt8Kernel
from services.worker.attention.cpu_prefill import PagedPrefillKernel, PrefillSlices, build_prefill_slices
from services.worker.attention.int8_kv_cache import Int8KVDequantizer, Int8KVWriter, int8_block_bytes
from services.worker.attention.torch_backend import (
    DecodeAttention,
    PrefillSlice,
    TorchAttentionBackend,
    TorchAttentionMetadata,
)


@dataclass(frozen=True)
class Int8DecodeMetadata:
    block_table: torch.Tensor  # [B_d, num_blocks], contiguous
    seq_lens: torch.Tensor  # [B_d]
    max_seq_len: int
    block_size: int  # the int8 rows' addresses depend on it; the cache shape does not show it


class Int8KernelDecode(DecodeAttention[Int8DecodeMetadata]):
    """Decodes on the compiled int8 kernel, which reads K/V rows and scales through the block table."""

    def __init__(self, kernel: PagedDecodeInt8Kernel, num_kv_heads: int, head_dim: int):
        self.kernel = kernel
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def build_metadata(self, block_table, seq_lens, max_seq_len, block_size) -> Int8DecodeMetadata:
        return Int8DecodeMetadata(block_table.contiguous(), seq_lens.contiguous(), max_seq_len, block_size)

    def forward(self, query, key_cache, value_cache, metadata: Int8DecodeMetadata, scale) -> torch.Tensor:
        out = self.kernel(query, key_cache, value_cache, metadata.block_table, metadata.seq_lens,
                          metadata.max_seq_len, scale, metadata.block_size, self.num_kv_heads, self.head_dim)
        return out.to(query.dtype).reshape(query.shape[0], -1)


@dataclass(frozen=True)
class Int8PrefillPlan:
    """A step's prefill slices over the dense cache of the blocks they read, built once per step."""

    block_ids: torch.Tensor  # [n] int64: the cache blocks, in the dense cache's order
    prefills: tuple[PrefillSlice, ...]  # block ids remapped into the dense cache (SDPA)
    slices: PrefillSlices | None  # likewise, for the prefill kernel; None without one


class Int8CacheCpuBackend(CpuAttentionBackend):
    name = "cpu-int8kv"

    def __init__(self, decode_kernel: PagedDecodeInt8Kernel, writer: Int8KVWriter, dequantizer: Int8KVDequantizer,
                 num_kv_heads: int, head_dim: int, prefill_kernel: PagedPrefillKernel | None = None):
        # Not CpuAttentionBackend.__init__: its decode reads a cache in the model's dtype.
        TorchAttentionBackend.__init__(self, Int8KernelDecode(decode_kernel, num_kv_heads, head_dim))
        self.prefill_kernel = prefill_kernel
        self.writer, self.dequantizer = writer, dequantizer
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, int8_block_bytes(block_size, num_kv_heads, head_dim))

    def build_metadata(self, common) -> TorchAttentionMetadata:
        metadata = TorchAttentionBackend.build_metadata(self, common)
        if not metadata.prefills:
            return metadata
        slices = build_prefill_slices(common)  # the same requests as metadata.prefills, in order
        block_ids, table = torch.unique(slices.block_table, return_inverse=True)
        table = table.to(torch.int64).contiguous()
        # Every slice, one without earlier context too, reads its keys as the cache holds them, so a
        # prompt attends to the same values on the prefill kernel and on SDPA, and later decodes do.
        bs = common.block_size
        prefills = tuple(replace(p, block_ids=table[i, : -(-p.seq_len // bs)]) for i, p in enumerate(metadata.prefills))
        plan = Int8PrefillPlan(block_ids=block_ids, prefills=prefills,
                               slices=replace(slices, block_table=table) if self.prefill_kernel is not None else None)
        return replace(metadata, prefill=plan)

    def write_kv(self, key, value, kv_cache, metadata: TorchAttentionMetadata) -> None:
        self.writer(key, value, kv_cache, metadata.slot_mapping, metadata.block_size)

    def attend_prefills(self, query, key, value, key_cache, value_cache, metadata: TorchAttentionMetadata, scale,
                        output) -> None:
        plan: Int8PrefillPlan = metadata.prefill
        dense = replace(metadata, prefills=plan.prefills, prefill=plan.slices)
        geometry = (metadata.block_size, self.num_kv_heads, self.head_dim, query.dtype)
        keys = self.dequantizer(key_cache, 0, plan.block_ids, *geometry)
        values = self.dequantizer(value_cache, 1, plan.block_ids, *geometry)
        super().attend_prefills(query, key, value, keys, values, dense, scale, output)
