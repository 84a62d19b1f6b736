"""PyTorch paged attention, the CPU path (and the reference for device kernels).

A step's batch splits in two groups, planned once per step:
- decodes (one query token): attended together by the backend's `DecodeAttention`. The default,
  `GatherDecode`, runs one SDPA call over K/V gathered block-wise into a padded [B, H_kv, L, D]
  tensor; the G = H / H_kv query heads that share a KV head ride as G query rows, so GQA needs no
  repeated K/V. The CPU backend (cpu_backend.py) plugs in the compiled kernel instead.
- prefills and chunks (several query tokens): one SDPA call each. A request with no earlier context
  attends to its own fresh K/V with a causal mask and never reads the cache. A subclass may attend
  them its own way (`attend_prefills`, with what it put in the metadata's `prefill`).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata

DecodeMetadataT = TypeVar("DecodeMetadataT")


class DecodeAttention(abc.ABC, Generic[DecodeMetadataT]):
    """How `TorchAttentionBackend` attends its decode tokens (one query each) over the paged cache."""

    @abc.abstractmethod
    def build_metadata(self, block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                       block_size: int) -> DecodeMetadataT:
        """Once per step, from the decodes' block table rows [B_d, num_blocks] (padded with block 0,
        `num_blocks` covering the longest) and lengths [B_d], the longest `max_seq_len`."""

    @abc.abstractmethod
    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: DecodeMetadataT, scale: float) -> torch.Tensor:
        """query [B_d, H, D] of the decode tokens in decode order, caches [num_blocks, bs, H_kv, D]
        holding this step's K/V -> attention output [B_d, H * D] in the query's dtype."""


@dataclass(frozen=True)
class PrefillSlice:
    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor | None  # None when the request has no earlier context


@dataclass(frozen=True)
class TorchDecodeMetadata:
    block_ids: torch.Tensor  # [B_d * num_blocks] flattened padded block tables
    mask: torch.Tensor  # [B_d, 1, 1, num_blocks * block_size] True = attend


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    block_size: int
    num_tokens: int
    # decodes
    is_all_decode: bool  # then decode i is token i, and no gather/scatter of queries is needed
    decode_token_indices: torch.Tensor | None  # [B_d] positions in the flat batch
    decode: object  # what the backend's DecodeAttention built for this step; None without decodes
    # prefills, in batch order
    prefills: tuple[PrefillSlice, ...]
    prefill: object = None  # what a subclass built for its own `attend_prefills`; None for SDPA


class GatherDecode(DecodeAttention[TorchDecodeMetadata]):
    """Decodes in one SDPA call over the blocks gathered into a padded tensor, with a length mask."""

    def build_metadata(self, block_table, seq_lens, max_seq_len, block_size) -> TorchDecodeMetadata:
        key_positions = torch.arange(block_table.shape[1] * block_size, device=seq_lens.device)
        mask = (key_positions[None, :] < seq_lens[:, None])[:, None, None, :]
        return TorchDecodeMetadata(block_table.reshape(-1), mask)

    def forward(self, query, key_cache, value_cache, metadata: TorchDecodeMetadata, scale) -> torch.Tensor:
        num_reqs = query.shape[0]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        q = query.view(num_reqs, num_kv_heads, -1, head_dim)  # [B, H_kv, G, D]
        k = _gather(key_cache, metadata.block_ids, num_reqs)
        v = _gather(value_cache, metadata.block_ids, num_reqs)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.mask, scale=scale)
        return out.reshape(num_reqs, -1)


class TorchAttentionBackend(AttentionBackend):
    """Prefills on PyTorch's SDPA; decodes on `decode` (default `GatherDecode`)."""

    name = "torch"

    def __init__(self, decode: DecodeAttention | None = None):
        self.decode = decode if decode is not None else GatherDecode()

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        bs = common.block_size
        starts = common.query_start_loc.tolist()
        decode_reqs = [i for i, n in enumerate(common.query_lens_cpu) if n == 1]
        is_all_decode = len(decode_reqs) == common.num_reqs
        decode_token_indices = decode = None
        if decode_reqs:
            idx = torch.tensor(decode_reqs, dtype=torch.long, device=common.seq_lens.device)
            decode_token_indices = common.query_start_loc[idx]
            max_seq_len = max(common.seq_lens_cpu[i] for i in decode_reqs)
            num_blocks = -(-max_seq_len // bs)
            if is_all_decode:
                block_table, seq_lens = common.block_table[:, :num_blocks], common.seq_lens
            else:
                block_table, seq_lens = common.block_table[idx, :num_blocks], common.seq_lens[idx]
            decode = self.decode.build_metadata(block_table, seq_lens, max_seq_len, bs)
        prefills = []
        for i, n in enumerate(common.query_lens_cpu):
            if n <= 1:
                continue
            seq_len = common.seq_lens_cpu[i]
            has_context = seq_len > n
            block_ids = common.block_table[i, : -(-seq_len // bs)] if has_context else None
            prefills.append(PrefillSlice(starts[i], starts[i + 1], seq_len, block_ids))
        return TorchAttentionMetadata(
            slot_mapping=common.slot_mapping,
            block_size=bs,
            num_tokens=common.num_tokens,
            is_all_decode=is_all_decode,
            decode_token_indices=decode_token_indices,
            decode=decode,
            prefills=tuple(prefills),
        )

    def write_kv(self, key, value, kv_cache, metadata: TorchAttentionMetadata) -> None:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        # Write in place through the slot mapping: the cache never grows or gets concatenated.
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)

    def attend(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata, scale):
        head_dim = key.shape[2]
        num_heads = query.shape[1]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if metadata.is_all_decode:
            return self.decode.forward(query, key_cache, value_cache, metadata.decode, scale)
        output = torch.empty(query.shape[0], num_heads * head_dim, dtype=query.dtype, device=query.device)
        if metadata.decode_token_indices is not None:
            decode_query = query[metadata.decode_token_indices]
            output[metadata.decode_token_indices] = self.decode.forward(decode_query, key_cache, value_cache,
                                                                        metadata.decode, scale)
        if metadata.prefills:
            self.attend_prefills(query, key, value, key_cache, value_cache, metadata, scale, output)
        return output

    def attend_prefills(self, query, key, value, key_cache, value_cache, metadata: TorchAttentionMetadata, scale,
                        output: torch.Tensor) -> None:
        """Writes the attention of the prefill slices' queries into their rows of `output` [T, H * D]:
        one SDPA call each."""
        for p in metadata.prefills:
            output[p.query_start : p.query_end] = _prefill(query, key, value, key_cache, value_cache, p, scale)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Blocks of `cache` [num_blocks, bs, H_kv, D] as [num_rows, H_kv, L, D] (L = blocks per row * bs)."""
    _, bs, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, block_ids)
    return gathered.view(num_rows, -1, num_kv_heads, head_dim).transpose(1, 2)


def _prefill(query, key, value, key_cache, value_cache, p: PrefillSlice, scale) -> torch.Tensor:
    # 4-D [1, H, n, D] inputs: with 3-D ones PyTorch's CPU dispatch falls back to the math kernel
    # (a materialised [H, n, L] score matrix), 2.5-4.5x slower than its flash kernel at these shapes.
    q = query[p.query_start : p.query_end].transpose(0, 1)[None]  # [1, H, n, D]
    num_query = p.query_end - p.query_start
    if p.block_ids is None:
        k = key[p.query_start : p.query_end].transpose(0, 1)[None]
        v = value[p.query_start : p.query_end].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        k = _gather(key_cache, p.block_ids, 1)[:, :, : p.seq_len]
        v = _gather(value_cache, p.block_ids, 1)[:, :, : p.seq_len]
        context_len = p.seq_len - num_query
        # Query token j sits at position context_len + j and sees keys up to that position.
        positions = torch.arange(p.seq_len, device=q.device)
        mask = positions[None, :] <= positions[context_len:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(num_query, -1)
