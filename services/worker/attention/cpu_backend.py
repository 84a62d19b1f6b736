"""CPU attention: the PyTorch backend with decode tokens on the compiled paged-decode kernel.

Prefills and chunks keep PyTorch's SDPA (their queries amortise the gather); decode tokens, where
the gather copy is most of the cost, read the paged cache in place (csrc/paged_decode.c).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata


@dataclass(frozen=True)
class CpuAttentionMetadata(TorchAttentionMetadata):
    decode_block_table: torch.Tensor | None = None  # [B_d, num_blocks] rows of the decodes
    decode_seq_lens: torch.Tensor | None = None  # [B_d]
    max_decode_seq_len: int = 0


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel: PagedDecodeKernel):
        self.kernel = kernel

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        base = super().build_metadata(common)
        fields = {name: getattr(base, name) for name in TorchAttentionMetadata.__dataclass_fields__}
        decode_reqs = [i for i, n in enumerate(common.query_lens_cpu) if n == 1]
        if not decode_reqs:
            return CpuAttentionMetadata(**fields)
        max_seq_len = max(common.seq_lens_cpu[i] for i in decode_reqs)
        num_blocks = -(-max_seq_len // common.block_size)
        if len(decode_reqs) == common.num_reqs:
            block_table, seq_lens = common.block_table[:, :num_blocks], common.seq_lens
        else:
            idx = torch.tensor(decode_reqs, dtype=torch.long)
            block_table, seq_lens = common.block_table[idx, :num_blocks], common.seq_lens[idx]
        return CpuAttentionMetadata(
            **fields,
            decode_block_table=block_table.contiguous(),
            decode_seq_lens=seq_lens.contiguous(),
            max_decode_seq_len=max_seq_len,
        )

    def _decode(self, query, key_cache, value_cache, m: CpuAttentionMetadata, scale) -> torch.Tensor:
        if not self.kernel.supports(key_cache.dtype):
            return super()._decode(query, key_cache, value_cache, m, scale)
        q = query if m.is_all_decode else query[m.decode_token_indices]
        out = self.kernel(q, key_cache, value_cache, m.decode_block_table, m.decode_seq_lens,
                          m.max_decode_seq_len, scale)
        return out.to(query.dtype).reshape(q.shape[0], -1)
