"""Two tensor-parallel ranks in one process: a model runner per rank, each on its own thread, over a
real gloo group on 127.0.0.1 (the rendezvous is the one workers use)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from services.common.messages import ModelRunnerOutput, SchedulerOutput
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import RunnerConfig
from services.worker.kv_cache import KVCacheLayout
from services.worker.layers.layer_ops import TorchLayerOps
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner
from services.worker.parallel import ModelShard, ShardPlan, TensorParallelGroup
from services.worker.platforms.cpu import CpuPlatform
from tests.e2e.cluster import free_port


def save_tiny_tied_model(path: Path, vocab_size: int) -> Path:
    """A 2-layer random Llama like harness.save_tiny_model's, with tied embeddings and `vocab_size`
    (an odd one does not divide over two ranks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True, rope_theta=10000.0))
    with torch.no_grad():
        for layer in model.model.layers:  # sharpen attention, as save_tiny_model does
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(str(path))
    return path


def make_rank_runner(model_dir: Path, group: TensorParallelGroup, block_size: int = 4, num_blocks: int = 128,
                     max_num_seqs: int = 16) -> ModelRunner:
    hf_config = load_config(model_dir)
    shard = ModelShard(ShardPlan.for_model(hf_config, group.world_size), group)
    local_config = shard.local_hf_config(hf_config)
    backend = TorchAttentionBackend()
    platform = CpuPlatform(torch.float32, backend, TorchLayerOps(), float32_copy=False)
    model = load_model(model_dir, platform, config=local_config, shard=shard)
    attn = model.attention_layers()
    layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, block_size, torch.float32)
    config = RunnerConfig(block_size=block_size, max_model_len=hf_config.max_position_embeddings,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    runner = ModelRunner(model, config, torch.device("cpu"), backend, layout, vocab_size=hf_config.vocab_size,
                         eos_token_ids=(2,), tp_group=group)
    runner.initialize_kv_cache(num_blocks)
    return runner


class TwoRanks:
    """Rank 0 and rank 1 of one model; `execute_model` runs a step on both at once and returns
    rank 0's output (rank 1's, which samples nothing, is kept in `last_rank1_output`)."""

    def __init__(self, model_dir: Path, timeout_s: float = 30.0, **runner_kwargs):
        self.port = free_port()
        self.groups = [TensorParallelGroup(rank, 2, torch.device("cpu"), timeout_s, "127.0.0.1") for rank in (0, 1)]
        self.threads = [ThreadPoolExecutor(1, thread_name_prefix=f"rank{rank}") for rank in (0, 1)]
        self.generation = 0
        self.rendezvous()
        self.runners = [make_rank_runner(model_dir, group, **runner_kwargs) for group in self.groups]
        self.last_rank1_output: ModelRunnerOutput | None = None

    def rendezvous(self) -> None:
        """Both ranks form a new group generation (as at a scheduler handshake)."""
        self.generation += 1
        futures = [t.submit(g.rendezvous, f"127.0.0.1:{self.port}", self.generation)
                   for t, g in zip(self.threads, self.groups)]
        for future in futures:
            future.result(timeout=60)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        futures = [t.submit(r.execute_model, scheduler_output) for t, r in zip(self.threads, self.runners)]
        rank0, self.last_rank1_output = (f.result(timeout=60) for f in futures)
        return rank0

    def close(self) -> None:
        for group in self.groups:
            group.close()
        for thread in self.threads:
            thread.shutdown(wait=False)
