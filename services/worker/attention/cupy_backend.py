"""Paged attention through the CUDA kernels (services/worker/kernels), the GPU path.

Per step, `build_metadata` keeps the int64 device tensors the kernels read, the host query and
sequence lengths and the longest sequence; per layer, `write_kv` writes this step's K/V with
`reshape_and_cache`, then `attend` runs attention:

- bfloat16/float16 with prefill rows (requests with more than one query token): the tiled
  tensor-core kernel `prefill_attention` for those rows, and `paged_attention` for the decode
  rows, gathered into a batch of their own (the split of a step is planned on the first layer's
  call and reused by the others);
- float32, or a step of decodes only: `paged_attention` over the whole batch in one launch (plus
  the split-K combine when contexts are long and the batch is small).

The launcher is injected: CuPy on a GPU, the CPU shim in tests, with identical arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata
from services.worker.kernels.attention_ops import group_tile, paged_attention, plan_partitions
from services.worker.kernels.cache_ops import reshape_and_cache
from services.worker.kernels.launch import Launcher
from services.worker.kernels.loader import HEAD_DIMS, PREFILL_DTYPES
from services.worker.kernels.prefill_attention_ops import (
    is_prefill,
    plan_prefill_tiles,
    prefill_attention,
    tile_plan_tensor,
)


@dataclass(frozen=True)
class DecodeRows:
    """A step's decode rows as a batch of their own, for `paged_attention`."""

    token_ids: torch.Tensor  # [num_decode_tokens] int64: their rows in the step's flat batch
    block_table: torch.Tensor  # [num_decode_reqs, max_blocks] int64
    query_start_loc: torch.Tensor  # [num_decode_reqs + 1] int64: 0, 1, 2, ...
    seq_lens: torch.Tensor  # [num_decode_reqs] int64
    max_seq_len: int


@dataclass(frozen=True)
class MixedStepPlan:
    """How a step with prefill rows splits between the two kernels, for one GQA group size."""

    tile_plan: torch.Tensor  # [num_tiles, 2] int32 (prefill_attention_ops.plan_prefill_tiles)
    decode: DecodeRows | None  # None when every request is a prefill


@dataclass(frozen=True)
class CupyAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    max_seq_len: int
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    has_prefill_rows: bool  # a request with more than one query token
    # Filled by the first layer's `mixed_plan` call of the step, per group size.
    _mixed_plans: dict[int, MixedStepPlan] = field(default_factory=dict, repr=False, compare=False)

    def mixed_plan(self, group: int) -> MixedStepPlan:
        """The prefill tiles for query heads in groups of `group` and the decode rows' own batch."""
        plan = self._mixed_plans.get(group)
        if plan is None:
            plan = self._mixed_plans[group] = self._build_mixed_plan(group)
        return plan

    def _build_mixed_plan(self, group: int) -> MixedStepPlan:
        device = self.query_start_loc.device
        tile_plan = tile_plan_tensor(plan_prefill_tiles(self.query_lens_cpu, group), device)
        decode_reqs = [r for r, n in enumerate(self.query_lens_cpu) if n == 1]
        if not decode_reqs:
            return MixedStepPlan(tile_plan, None)
        starts = [0]
        for n in self.query_lens_cpu:
            starts.append(starts[-1] + n)
        reqs = torch.tensor(decode_reqs, dtype=torch.int64).to(device)
        decode = DecodeRows(
            token_ids=torch.tensor([starts[r] for r in decode_reqs], dtype=torch.int64).to(device),
            block_table=self.block_table.index_select(0, reqs),
            query_start_loc=torch.arange(len(decode_reqs) + 1, dtype=torch.int64, device=device),
            seq_lens=self.seq_lens.index_select(0, reqs),
            max_seq_len=max(self.seq_lens_cpu[r] for r in decode_reqs),
        )
        return MixedStepPlan(tile_plan, decode)


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
            query_lens_cpu=tuple(common.query_lens_cpu),
            seq_lens_cpu=tuple(common.seq_lens_cpu),
            has_prefill_rows=any(is_prefill(n) for n in common.query_lens_cpu),
        )

    def write_kv(self, key, value, kv_cache, metadata: CupyAttentionMetadata) -> None:
        write = reshape_and_cache(kv_cache, key, value, metadata.slot_mapping)
        if write is not None:
            self.launcher(write)

    def attend(self, query, key, value, kv_cache, metadata: CupyAttentionMetadata, scale):
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=query.dtype, device=query.device)
        if query.dtype not in PREFILL_DTYPES or not metadata.has_prefill_rows:
            self._paged(out, query, kv_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
                        metadata.max_seq_len, scale)
            return out
        plan = metadata.mixed_plan(num_heads // key.shape[1])
        launch = prefill_attention(out, query, kv_cache, metadata.block_table, metadata.query_start_loc,
                                   metadata.seq_lens, plan.tile_plan, scale)
        if launch is not None:
            self.launcher(launch)
        if plan.decode is not None:
            d = plan.decode
            decode_out = torch.empty(d.token_ids.shape[0], num_heads * head_dim, dtype=query.dtype,
                                     device=query.device)
            self._paged(decode_out, query.index_select(0, d.token_ids), kv_cache, d.block_table, d.query_start_loc,
                        d.seq_lens, d.max_seq_len, scale)
            out.index_copy_(0, d.token_ids, decode_out)
        return out

    def _paged(self, out, query, kv_cache, block_table, query_start_loc, seq_lens, max_seq_len: int, scale) -> None:
        """`paged_attention` over the batch these tensors describe, split-K when the GPU would idle."""
        num_tokens, num_heads, _ = query.shape
        num_kv_heads = kv_cache.shape[3]
        num_ctas = num_tokens * num_kv_heads * -(-(num_heads // num_kv_heads) // group_tile(num_heads, num_kv_heads))
        num_partitions = plan_partitions(max_seq_len, num_ctas, self.num_sms)
        for launch in paged_attention(out, query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                                      max_seq_len, num_partitions):
            self.launcher(launch)
