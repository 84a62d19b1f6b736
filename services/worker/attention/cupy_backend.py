"""Paged attention through the CUDA kernels (services/worker/kernels), the GPU path.

Per step, `build_metadata` keeps the int64 device tensors the kernels read and the longest
sequence (a host value); per layer, `write_kv` writes this step's K/V with `reshape_and_cache`,
then `attend` runs `paged_attention` over the whole mixed batch in one launch (plus the split-K
combine when contexts are long and the batch is small). The launcher is injected: CuPy on a GPU,
the CPU shim in tests, with identical arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata
from services.worker.kernels.attention_ops import group_tile, paged_attention, plan_partitions
from services.worker.kernels.cache_ops import reshape_and_cache
from services.worker.kernels.launch import Launcher
from services.worker.kernels.loader import HEAD_DIMS


@dataclass(frozen=True)
class CupyAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    max_seq_len: int


class CupyAttentionBackend(AttentionBackend):
    name = "cupy"

    def __init__(self, launcher: Launcher, num_sms: int):
        self.launcher = launcher
        self.num_sms = num_sms

    @staticmethod
    def supports(head_dim: int) -> bool:
        return head_dim in HEAD_DIMS

    def build_metadata(self, common: CommonAttentionMetadata) -> CupyAttentionMetadata:
        def int64(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.int64).contiguous()

        return CupyAttentionMetadata(
            slot_mapping=int64(common.slot_mapping),
            block_table=int64(common.block_table),
            query_start_loc=int64(common.query_start_loc),
            seq_lens=int64(common.seq_lens),
            max_seq_len=max(common.seq_lens_cpu, default=0),
        )

    def write_kv(self, key, value, kv_cache, metadata: CupyAttentionMetadata) -> None:
        write = reshape_and_cache(kv_cache, key, value, metadata.slot_mapping)
        if write is not None:
            self.launcher(write)

    def attend(self, query, key, value, kv_cache, metadata: CupyAttentionMetadata, scale):
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=query.dtype, device=query.device)
        num_ctas = num_tokens * num_kv_heads * -(-(num_heads // num_kv_heads) // group_tile(num_heads, num_kv_heads))
        num_partitions = plan_partitions(metadata.max_seq_len, num_ctas, self.num_sms)
        for launch in paged_attention(out, query, kv_cache, metadata.block_table, metadata.query_start_loc,
                                      metadata.seq_lens, scale, metadata.max_seq_len, num_partitions):
            self.launcher(launch)
        return out
