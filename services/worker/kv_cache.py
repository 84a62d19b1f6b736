"""KV cache sizing and allocation.

On a CPU the cache gets a configured byte budget; the number of blocks that fit is what the worker
reports to the scheduler, which owns the block ids from then on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.int8_kv_cache import int8_row_bytes


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's per-layer KV geometry; one cache tensor per attention layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's
    kv_cache_dtype: str = "auto"  # auto: keys and values in `dtype`; int8: attention/int8_kv_cache.py

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.int8 if self.kv_cache_dtype == "int8" else self.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values (int8: with their scales and midpoints)."""
        if self.kv_cache_dtype == "int8":
            row_bytes = int8_row_bytes(self.head_dim)
        else:
            row_bytes = self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row_bytes


def num_blocks_for_budget(layout: KVCacheLayout, kv_cache_bytes: int, max_model_len: int, max_num_seqs: int) -> int:
    """Blocks (null block included) that fit in `kv_cache_bytes`, capped at what `max_num_seqs`
    requests of `max_model_len` tokens could ever use.

    Raises ValueError when not even one request of `max_model_len` tokens fits.
    """
    blocks_per_seq = -(-max_model_len // layout.block_size)
    num_blocks = min(kv_cache_bytes // layout.bytes_per_block, max_num_seqs * blocks_per_seq + 1)
    if num_blocks - 1 < blocks_per_seq:
        raise ValueError(
            f"KV cache budget of {kv_cache_bytes / 2**20:.0f} MiB holds {num_blocks} blocks of "
            f"{layout.bytes_per_block} bytes, too few for one request of max_model_len={max_model_len} "
            f"({blocks_per_seq} blocks + the null block): raise --kv-cache-bytes or lower --max-model-len"
        )
    return int(num_blocks)


def allocate_kv_caches(
    layout: KVCacheLayout, num_blocks: int, backend: AttentionBackend, device: torch.device
) -> list[torch.Tensor]:
    """Zero-filled caches: padded block-table entries read block 0, which must hold finite values."""
    shape = backend.get_kv_cache_shape(num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    with torch.inference_mode():
        return [torch.zeros(shape, dtype=layout.cache_dtype, device=device) for _ in range(layout.num_layers)]
