"""Tensor parallelism: one engine's model split over several worker ranks (torch.distributed, gloo
on CPUs, NCCL on GPUs). `shard_plan` decides each rank's heads, intermediate slice and LM head
vocabulary slice, `weights` cuts checkpoint tensors to them, `model_shard` applies both as the
model is built (`vocab_parallel` is its LM head), and `process_group` forms the ranks' group at
each scheduler handshake and runs the collectives."""
from services.worker.parallel.model_shard import ModelShard, RowParallelLinear
from services.worker.parallel.process_group import CollectiveError, TensorParallelGroup
from services.worker.parallel.shard_plan import RankShard, ShardPlan
from services.worker.parallel.vocab_parallel import VocabParallelLMHead

__all__ = ["CollectiveError", "ModelShard", "RankShard", "RowParallelLinear", "ShardPlan", "TensorParallelGroup",
           "VocabParallelLMHead"]
