"""KV cache sizing on a GPU: profile a forward at the token budget, give the cache the rest.

budget = gpu_memory_utilization * total - peak PyTorch memory of a forward over
min(max_num_batched_tokens, max_model_len) tokens (weights, activations, logits) - memory that
other processes or non-PyTorch allocations hold. The worker reports the blocks that fit.
"""
from __future__ import annotations

import logging

import torch

from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata
from services.worker.config import RunnerConfig
from services.worker.kv_cache import KVCacheLayout, allocate_kv_caches

logger = logging.getLogger(__name__)


def profile_kv_cache_bytes(model, backend: AttentionBackend, layout: KVCacheLayout, config: RunnerConfig,
                           utilization: float, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    held_elsewhere = total - free - torch.cuda.memory_reserved(device)
    num_tokens = min(config.max_num_batched_tokens, config.max_model_len)
    num_blocks = -(-num_tokens // layout.block_size) + 1  # + the null block
    caches = allocate_kv_caches(layout, num_blocks, backend, device)
    layers = model.attention_layers()
    saved = [layer.kv_cache for layer in layers]
    try:
        for layer, cache in zip(layers, caches):
            layer.kv_cache = cache
        # One throwaway request: a prefill of num_tokens tokens in blocks 1.. (block 0 is null).
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, num_tokens], device=device),
            seq_lens=torch.tensor([num_tokens], device=device),
            slot_mapping=torch.arange(num_tokens, device=device) + layout.block_size,
            block_table=torch.arange(1, num_blocks, device=device)[None],
            block_size=layout.block_size,
            query_lens_cpu=[num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
            positions = torch.arange(num_tokens, device=device)
            hidden = model(ids, positions, backend.build_metadata(common))
            model.compute_logits(hidden[: min(num_tokens, config.max_num_seqs)])
        torch.cuda.synchronize(device)
    finally:
        for layer, cache in zip(layers, saved):
            layer.kv_cache = cache
    profile_cache_bytes = num_blocks * layout.bytes_per_block
    peak = torch.cuda.max_memory_allocated(device) - profile_cache_bytes
    del caches
    torch.cuda.empty_cache()
    budget = int(total * utilization - peak - held_elsewhere)
    logger.info("GPU memory: %.1f GiB total, forward peak %.2f GiB, %.2f GiB held elsewhere -> KV cache %.2f GiB",
                total / 2**30, peak / 2**30, held_elsewhere / 2**30, budget / 2**30)
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} leaves no room for the KV cache "
                         f"(forward peak {peak / 2**30:.2f} GiB of {total / 2**30:.1f} GiB)")
    return budget
