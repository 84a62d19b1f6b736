"""The worker: owns the device, the weights, the KV cache and the model runner.

Synchronous and gRPC-free; the server calls it from one dedicated thread.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from services.common.model_files import eos_token_ids, resolve_model
from services.worker.config import RunnerConfig, WorkerConfig, resolve_device, resolve_dtype
from services.worker.kv_cache import KVCacheLayout, num_blocks_for_budget
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner
from services.worker.platforms import AttentionHeads, Platform, build_platform
from services.worker.structured_output.grammar_compiler import GrammarCompiler

if TYPE_CHECKING:  # imported by tensor-parallel workers only
    from services.worker.parallel import ModelShard, TensorParallelGroup

logger = logging.getLogger(__name__)


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    """The flag's value, capped by the model's position limit (and a sliding window, which our
    attention does not implement, so longer sequences are refused rather than computed wrongly)."""
    limit = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, int(window))
    return min(requested, limit) if requested else limit


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = resolve_device(config.device, config.tensor_parallel_rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_name = ""
        self.platform: Platform | None = None  # built by load_model, for the model's heads
        self.model_runner: ModelRunner | None = None
        self.kv_cache_spec: KVCacheSpec | None = None
        self.num_blocks = 0  # allocated by initialize_kv_cache
        # Tensor parallelism only: this rank's process group, formed at each InitializeKVCache.
        self.tp_group: TensorParallelGroup | None = None

    @property
    def is_sampling_rank(self) -> bool:
        return self.config.tensor_parallel_rank == 0

    def load_model(self) -> None:
        """Resolves (and if needed converts) the model, loads weights, sizes the KV cache."""
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        if self.config.fake_model:  # no weights: the engine-overhead benchmark's worker
            from services.worker.fake_runner import load_fake_model

            self.model_runner, spec = load_fake_model(self.config, self.dtype)
            # Fake ranks hold no shard and run no collectives: only the scheduler's fan-out is measured.
            self.kv_cache_spec = dataclasses.replace(spec, **self._rank_fields(f"fake tp={self.config.tensor_parallel_size}"))
            self.model_name = self.kv_cache_spec.model_name
            logger.info("fake model: no weights, every step returns a fixed token at once")
            return
        logger.info("resolving model %s", self.config.model or "(embedded default)")
        resolved = resolve_model(self.config.model, self.config.cache_dir)
        self.model_name = self.config.served_model_name or resolved.name
        logger.info("loading weights from %s (%s, %s)", resolved.path, self.device, _dtype_name(self.dtype))
        hf_config = load_config(resolved.path)
        shard, shard_layout = self._model_shard(hf_config), ""
        local_config = hf_config
        if shard is not None:
            local_config, shard_layout = shard.local_hf_config(hf_config), shard.plan.describe()
            # Ranks must agree on the weights' format too: the layout line carries it.
            shard_layout += f" quantization={self.config.quantization}"
            logger.info("tensor parallel rank %d of %d: %s", shard.rank, shard.plan.world_size, shard_layout)
        platform = build_platform(self.config, self.device, self.dtype, AttentionHeads.from_hf_config(local_config))
        self.platform = platform
        model = load_model(resolved.path, platform, config=local_config, shard=shard)
        runner_config = RunnerConfig(
            block_size=self.config.block_size,
            max_model_len=resolve_max_model_len(hf_config, self.config.max_model_len),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )
        attn = model.attention_layers()
        layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, self.config.block_size, self.dtype,
                               self.config.kv_cache_dtype)
        kv_cache_bytes = platform.kv_cache_bytes(model, layout, runner_config)
        logger.info("sizing KV cache: %.0f MiB budget, %d bytes per block (%s)", kv_cache_bytes / 2**20,
                    layout.bytes_per_block, _dtype_name(layout.cache_dtype))
        num_blocks = num_blocks_for_budget(
            layout, kv_cache_bytes, runner_config.max_model_len, runner_config.max_num_seqs
        )
        backend = platform.attention_backend
        eos_ids = eos_token_ids(resolved.path)
        grammar_compiler = None  # ranks that do not sample hold no grammars
        if self.is_sampling_rank:
            grammar_compiler = GrammarCompiler(resolved.path, hf_config.vocab_size, eos_ids)
            grammar_compiler.warm_up()
        self.model_runner = ModelRunner(
            model, runner_config, platform.device, backend, layout,
            vocab_size=hf_config.vocab_size, eos_token_ids=eos_ids, sampler=platform.sampler,
            grammar_compiler=grammar_compiler, tp_group=self.tp_group,
        )
        self.kv_cache_spec = KVCacheSpec(
            block_size=self.config.block_size,
            num_blocks=num_blocks,
            block_bytes=layout.bytes_per_block,
            max_model_len=runner_config.max_model_len,
            model_name=self.model_name,
            device=self.device.type,  # "cuda", whichever GPU this rank took
            dtype=_dtype_name(self.dtype),
            vocab_size=hf_config.vocab_size,
            attention_backend=backend.name,
            **self._rank_fields(shard_layout),
        )
        logger.info("%s platform: attention backend %s%s, layer ops %s, sampler %s", platform.name, backend.name,
                    " (compiled C decode kernel)" if backend.name == "cpu" else "", type(platform.layer_ops).__name__,
                    type(platform.sampler).__name__)

    def _model_shard(self, hf_config) -> ModelShard | None:
        """This rank's shard and process group (not yet formed); None without tensor parallelism."""
        if self.config.tensor_parallel_size == 1:
            return None
        from services.worker.parallel import ModelShard, ShardPlan, TensorParallelGroup

        plan = ShardPlan.for_model(hf_config, self.config.tensor_parallel_size)
        self.tp_group = TensorParallelGroup(
            self.config.tensor_parallel_rank, self.config.tensor_parallel_size, self.device,
            self.config.tensor_parallel_timeout_s, local_host=self.config.worker_addr.rpartition(":")[0])
        return ModelShard(plan, self.tp_group)

    def _rank_fields(self, shard_layout: str) -> dict:
        config = self.config
        if config.tensor_parallel_size == 1:
            return {}
        return dict(tensor_parallel_rank=config.tensor_parallel_rank, tensor_parallel_size=config.tensor_parallel_size,
                    shard_layout=shard_layout, tensor_parallel_port=config.tensor_parallel_port)

    def describe_kv_cache(self) -> KVCacheSpec:
        if self.kv_cache_spec is None:
            raise RuntimeError("model not loaded yet")
        return self.kv_cache_spec

    def initialize_kv_cache(self, num_blocks: int, rendezvous_addr: str = "", generation: int = 0) -> tuple[int, int]:
        """Allocates min(num_blocks, what fits) blocks (all that fit when num_blocks <= 0) and drops
        every request of an earlier scheduler connection. Returns (num_blocks, bytes). A tensor-parallel
        rank first forms generation `generation`'s process group at `rendezvous_addr` with the other
        ranks (CollectiveError when they do not all arrive in time)."""
        spec = self.describe_kv_cache()
        if self.tp_group is not None:
            if not rendezvous_addr:
                raise ValueError(f"rank {self.tp_group.rank} of {self.tp_group.world_size} needs a rendezvous "
                                 "address in InitializeKVCache: is the scheduler's --tensor-parallel-size set?")
            self.tp_group.rendezvous(rendezvous_addr, generation)
        num_blocks = spec.num_blocks if num_blocks <= 0 else max(1, min(num_blocks, spec.num_blocks))
        start = time.monotonic()
        num_bytes = self.model_runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB) allocated in %.2f s",
                    num_blocks, spec.block_size, num_bytes / 2**20, time.monotonic() - start)
        return num_blocks, num_bytes

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.model_runner is None:
            raise RuntimeError("model not loaded yet")
        output = self.model_runner.execute_model(scheduler_output)
        if not self.is_sampling_rank:  # only rank 0's tokens go back; the others acknowledge the step
            return ModelRunnerOutput(step_id=output.step_id)
        return output


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
