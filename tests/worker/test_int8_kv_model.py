"""A whole model over the int8 KV cache: a tiny random Llama with head_dim 64 (so the int8 decode
kernel's fast path and, in bfloat16, the prefill kernel run) served through the runner with chunked
prefills and batched decodes, its greedy tokens checked against transformers in float32 by teacher
forcing.

The documented agreement (docs/benchmarks.md, "The int8 KV cache"): every greedy token of the int8
cache is within the reference's top 3 at its position, and at least 90% of them are the reference's
own argmax (float32 weights; bfloat16 weights carry their own rounding on top)."""
from __future__ import annotations

import pytest
import torch

from services.worker.config import RunnerConfig, WorkerConfig
from services.worker.kv_cache import KVCacheLayout
from services.worker.model_loader import load_config, load_model
from services.worker.model_runner import ModelRunner
from services.worker.platforms import AttentionHeads, build_platform
from tests.top_k_agreement import check_within_reference_top_k
from tests.worker.harness import VOCAB_SIZE, MiniScheduler, save_llama_head_dim_64

TOP_K = 3
MIN_ARGMAX_SHARE = 0.9
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama_head_dim_64(tmp_path_factory.mktemp("llama-d64"))


def _runner(model_dir, dtype: torch.dtype, kv_cache_dtype: str, cache_dir) -> ModelRunner:
    hf_config = load_config(model_dir)
    worker_config = WorkerConfig(kv_cache_dtype=kv_cache_dtype, cache_dir=str(cache_dir))
    platform = build_platform(worker_config, torch.device("cpu"), dtype, AttentionHeads.from_hf_config(hf_config))
    model = load_model(model_dir, platform, config=hf_config)
    attn = model.attention_layers()
    layout = KVCacheLayout(len(attn), attn[0].num_kv_heads, attn[0].head_dim, BLOCK_SIZE, dtype, kv_cache_dtype)
    config = RunnerConfig(block_size=BLOCK_SIZE, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048)
    runner = ModelRunner(model, config, torch.device("cpu"), platform.attention_backend, layout,
                         vocab_size=hf_config.vocab_size, eos_token_ids=(2,))
    runner.initialize_kv_cache(64)
    return runner


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {f"req-{i}": torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for i, n in enumerate([70, 9, 150, 33])}


def _greedy(runner: ModelRunner, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    scheduler = MiniScheduler(block_size=BLOCK_SIZE, token_budget=64)  # chunked prefills beside decodes
    for req_id, prompt in prompts.items():
        scheduler.add(req_id, prompt, max_tokens=max_tokens)
    scheduler.run(runner)
    return {req_id: scheduler.outputs(req_id) for req_id in prompts}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cache_greedy_tokens_stay_within_the_float32_references_top_k(model_dir, dtype, kernel_cache):
    runner = _runner(model_dir, dtype, "int8", kernel_cache)
    assert runner.kv_caches[0].dtype == torch.int8
    prompts = _prompts()
    outputs = _greedy(runner, prompts, max_tokens=24)
    check_within_reference_top_k(model_dir, list(prompts.values()), [outputs[r] for r in prompts], TOP_K,
                                 MIN_ARGMAX_SHARE, 24)
