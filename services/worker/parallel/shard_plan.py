"""Which part of a Llama-family model each tensor-parallel rank holds.

Attention is split by whole KV groups: a rank holds some KV heads and every query head that reads
them, so attention needs no communication. When the KV heads do not divide evenly the split is
uneven, earlier ranks taking one more: SmolLM2-135M (9 query heads, 3 KV heads, groups of 3) at
two ranks gives rank 0 KV heads 0-1 with query heads 0-5 and rank 1 KV head 2 with query heads 6-8.
With fewer KV heads than ranks each KV head is replicated on `world_size // num_kv_heads` ranks and
the query heads are split evenly (both counts must then divide). The MLP's intermediate dimension
is split in contiguous chunks, earlier ranks taking one more when it does not divide.

The LM head is split by vocabulary in contiguous row ranges, earlier ranks taking one more when
the vocabulary does not divide (vocab_parallel.py gathers the slices' logits to rank 0); the
embedding stays replicated. Measured on two gloo ranks with the CPU platform's prepacked weights,
SmolLM2's 49,152 x 576 (docs/benchmarks.md): the split head is faster than the replicated one on
rank 0 at 1 and 32 rows in float32 (9.1 -> 6.4 ms, 20.9 -> 18.7) and bfloat16 (4.9 -> 3.4,
11.3 -> 8.1), while a split embedding costs an all-reduce of every token's hidden state (2-7x
slower than a replicated lookup). So every plan of more than one rank splits the LM head alone.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class RankShard:
    """One rank's slices, as [start, stop) ranges of heads, of the intermediate dimension and of the
    LM head's vocabulary rows."""

    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range


def split_evenly(total: int, num_parts: int) -> list[range]:
    """Contiguous ranges covering [0, total), sizes differing by at most one, larger ones first."""
    base, extra = divmod(total, num_parts)
    ranges, start = [], 0
    for part in range(num_parts):
        size = base + (1 if part < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class ShardPlan:
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    ranks: tuple[RankShard, ...]

    @classmethod
    def for_model(cls, hf_config, world_size: int) -> ShardPlan:
        """Raises ValueError when the model's heads cannot be split over `world_size` ranks."""
        if world_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {world_size}")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        intermediate_size = hf_config.intermediate_size
        vocab_size = hf_config.vocab_size
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        if num_kv_heads >= world_size:
            kv_ranges = split_evenly(num_kv_heads, world_size)
            q_ranges = [range(r.start * group, r.stop * group) for r in kv_ranges]
        else:
            if world_size % num_kv_heads or num_heads % world_size:
                raise ValueError(
                    f"{num_kv_heads} KV heads and {num_heads} query heads cannot be split over {world_size} "
                    "ranks: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads "
                    "and divide the query heads")
            num_q = num_heads // world_size
            replicas = world_size // num_kv_heads
            q_ranges = [range(r * num_q, (r + 1) * num_q) for r in range(world_size)]
            kv_ranges = [range(r // replicas, r // replicas + 1) for r in range(world_size)]
        for name, size in (("intermediate size", intermediate_size), ("vocabulary", vocab_size)):
            if size < world_size:
                raise ValueError(f"{name} {size} is smaller than {world_size} ranks")
        ranks = tuple(RankShard(q, kv, inter, vocab) for q, kv, inter, vocab in zip(
            q_ranges, kv_ranges, split_evenly(intermediate_size, world_size), split_evenly(vocab_size, world_size),
            strict=True))
        return cls(world_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size, ranks)

    def describe(self) -> str:
        """The whole layout in one line: equal on every rank of one engine, or they cannot work together."""
        def sizes(attr: str) -> str:
            return "+".join(str(len(getattr(r, attr))) for r in self.ranks)

        replicated = " replicated" if self.num_kv_heads < self.world_size else ""
        return (f"tp={self.world_size} q_heads={sizes('q_heads')} kv_heads={sizes('kv_heads')}{replicated} "
                f"head_dim={self.head_dim} intermediate={sizes('intermediate')} lm_head_vocab={sizes('vocab')} "
                "embedding=replicated")

    def local_hf_config(self, hf_config, rank: int):
        """A copy of the HF config with this rank's head and intermediate counts, so the model is
        built at the rank's size by the unchanged model code."""
        shard = self.ranks[rank]
        local = copy.deepcopy(hf_config)
        local.num_attention_heads = len(shard.q_heads)
        local.num_key_value_heads = len(shard.kv_heads)
        local.head_dim = self.head_dim  # no longer hidden_size // num_attention_heads
        local.intermediate_size = len(shard.intermediate)
        return local
