"""Checkpoint tensors cut to one rank's shard, on their way from the file to the model.

Column-parallel projections (q, k, v, gate, up) keep the output rows of the rank's heads or
intermediate chunk; row-parallel ones (o_proj, down_proj) keep the matching input columns, and
their bias only on rank 0 (the other ranks get zeros), since the all-reduce that follows sums
every rank's output. The LM head keeps the rows of the rank's vocabulary slice. Everything else
(embedding, norms) is replicated; a tied checkpoint's copy of the LM head is cut too, then skipped
by the model, whose head reads the embedding's rows.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from services.worker.parallel.shard_plan import RankShard, ShardPlan

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("lm_head.weight",)


def _rows(shard: RankShard, plan: ShardPlan, projection: str) -> range:
    """The slice of the projection's output (column-parallel) or input (row-parallel) dimension."""
    if projection in ("q_proj", "o_proj"):
        heads = shard.q_heads
    elif projection in ("k_proj", "v_proj"):
        heads = shard.kv_heads
    else:
        return shard.intermediate
    return range(heads.start * plan.head_dim, heads.stop * plan.head_dim)


def shard_tensor(name: str, tensor: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
    """The part of checkpoint tensor `name` that rank `rank` holds (the tensor itself if replicated)."""
    if name in VOCAB_PARALLEL:
        vocab = plan.ranks[rank].vocab
        return tensor[vocab.start : vocab.stop]
    parts = name.rsplit(".", 2)
    if len(parts) < 3:
        return tensor
    projection, kind = parts[1], parts[2]
    if projection in COLUMN_PARALLEL:
        part = _rows(plan.ranks[rank], plan, projection)
        return tensor[part.start : part.stop]
    if projection in ROW_PARALLEL:
        if kind == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        part = _rows(plan.ranks[rank], plan, projection)
        return tensor[:, part.start : part.stop]
    return tensor


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], plan: ShardPlan, rank: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, shard_tensor(name, tensor, plan, rank)
