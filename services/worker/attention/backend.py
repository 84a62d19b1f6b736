"""The attention backend interface and the per-step metadata every backend starts from.

KV cache layout (one tensor per layer): [2, num_blocks, block_size, num_kv_heads, head_dim],
index 0 holding keys and 1 values. Token slot `s` lives at block `s // block_size`, offset
`s % block_size`. Block 0 is the null block: the scheduler never hands it out, and padded block
table entries point at it, so it must hold finite values (the cache is zero-filled).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """Where each request's tokens sit in the flat batch and in the paged cache, for one step.

    Requests are in batch order; request i owns query tokens
    `query_start_loc[i]:query_start_loc[i+1]`, which are its last tokens of `seq_lens[i]`.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64: context + this step's tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each token's K/V
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int64: padded with block 0
    block_size: int
    # Host copies, so backends can plan without reading device tensors.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionMetadata(Protocol):
    """What every backend's per-step metadata offers the layers (the rest is the backend's own)."""

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[num_tokens] int64: the cache slot of each token's K/V."""


class AttentionBackend(abc.ABC):
    """Paged attention for one device: cache layout, per-step planning, and the layer call, which
    is `write_kv` then `attend` (the layer may have a fused op write the cache instead, in the
    same layout at the same slots)."""

    name: str = "abstract"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @abc.abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """Turns the common metadata into what `attend` needs; called once per step, not per layer."""

    @abc.abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        """Writes this step's key/value [T, H_kv, D] into `kv_cache` at the metadata's slot mapping.

        Called for all of a step's tokens before `attend` in the same layer: a request may attend to
        blocks another request of the same step fills (the scheduler registers prompt blocks in the
        prefix cache as it schedules them)."""

    @abc.abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of every query [T, H, D] over its own request's context (read through
        the block table), as [T, H * D], once this step's key/value [T, H_kv, D] are in `kv_cache`.
        H must be a multiple of H_kv (GQA)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """`write_kv`, then `attend`."""
        self.write_kv(key, value, kv_cache, metadata)
        return self.attend(query, key, value, kv_cache, metadata, scale)
