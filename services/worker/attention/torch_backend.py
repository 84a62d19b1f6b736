"""PyTorch paged attention, the CPU path (and the reference for device kernels).

A step's batch splits in two groups, planned once per step:
- decodes (one query token): attended together in one SDPA call over K/V gathered block-wise into
  a padded [B, H_kv, L, D] tensor; the G = H / H_kv query heads that share a KV head ride as G
  query rows, so GQA needs no repeated K/V.
- prefills and chunks (several query tokens): one SDPA call each. A request with no earlier context
  attends to its own fresh K/V with a causal mask and never reads the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata


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
    decode: Any  # what this backend's `_decode` reads (from `_decode_metadata`); None without decodes
    # prefills, in batch order
    prefills: tuple[PrefillSlice, ...]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
            decode = self._decode_metadata(block_table, seq_lens, max_seq_len, bs)
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

    def _decode_metadata(self, block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                         block_size: int) -> Any:
        """Once per step, from the decodes' block table rows [B_d, num_blocks] and lengths [B_d]."""
        key_positions = torch.arange(block_table.shape[1] * block_size, device=seq_lens.device)
        mask = (key_positions[None, :] < seq_lens[:, None])[:, None, None, :]
        return TorchDecodeMetadata(block_table.reshape(-1), mask)

    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata, scale):
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        # Write in place through the slot mapping: the cache never grows or gets concatenated.
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)
        return self.attend(query, key, value, kv_cache, metadata, scale)

    def attend(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata, scale):
        """`forward` for a step whose key/value are already in `kv_cache` (the fused CPU kernel wrote them)."""
        head_dim = key.shape[2]
        num_heads = query.shape[1]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if metadata.is_all_decode:
            return self._decode(query, key_cache, value_cache, metadata, scale)
        output = torch.empty(query.shape[0], num_heads * head_dim, dtype=query.dtype, device=query.device)
        if metadata.decode_token_indices is not None:
            output[metadata.decode_token_indices] = self._decode(query, key_cache, value_cache, metadata, scale)
        for p in metadata.prefills:
            output[p.query_start : p.query_end] = _prefill(query, key, value, key_cache, value_cache, p, scale)
        return output

    def _decode(self, query, key_cache, value_cache, metadata: TorchAttentionMetadata, scale) -> torch.Tensor:
        return _decode(query, key_cache, value_cache, metadata, scale)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Blocks of `cache` [num_blocks, bs, H_kv, D] as [num_rows, H_kv, L, D] (L = blocks per row * bs)."""
    _, bs, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, block_ids)
    return gathered.view(num_rows, -1, num_kv_heads, head_dim).transpose(1, 2)


def _decode(query, key_cache, value_cache, m: TorchAttentionMetadata, scale) -> torch.Tensor:
    num_reqs = m.decode_token_indices.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    q = query if m.is_all_decode else query[m.decode_token_indices]
    q = q.view(num_reqs, num_kv_heads, -1, head_dim)  # [B, H_kv, G, D]
    k = _gather(key_cache, m.decode.block_ids, num_reqs)
    v = _gather(value_cache, m.decode.block_ids, num_reqs)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.decode.mask, scale=scale)
    return out.reshape(num_reqs, -1)


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
