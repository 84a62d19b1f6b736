"""The three services with `SPINDLE_KV_CACHE_DTYPE=int8` on a tiny random Llama: concurrent
requests through chunked prefill and preemption in a cache of few blocks, their greedy tokens
within transformers' float32 top 3 by teacher forcing (the documented agreement of
tests/worker/test_int8_kv_model.py), every block back afterwards, and a prefix-cache hit serving
the same tokens as the cold request."""
from __future__ import annotations

import random

import openai
import pytest

from tests.e2e.cluster import SpindleCluster
from tests.e2e.probes import complete_all, engine_stats
from tests.e2e.test_tiny_models import build_tiny_model
from tests.top_k_agreement import check_within_reference_top_k

MAX_TOKENS = 24
NUM_PROMPTS = 8
TOP_K = 3
MIN_ARGMAX_SHARE = 0.9
# 2 layers x 2 KV heads x (16 int8 + a 4-byte scale) x 16 slots x (K, V) = 2,560 bytes a block:
# 40 blocks hold 640 tokens, fewer than the prompts need at once, so requests are preempted.
BLOCK_BYTES = 2 * 2 * (16 + 4) * 16 * 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
    rng = random.Random("llama")
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(40, 140))] for _ in range(NUM_PROMPTS)]
    cluster = SpindleCluster(tmp_path_factory.mktemp("logs-int8kv"), env={
        "SPINDLE_MODEL": str(model_dir),
        "SPINDLE_KV_CACHE_DTYPE": "int8",
        "SPINDLE_KV_CACHE_BYTES": str(40 * BLOCK_BYTES),
        "SPINDLE_MAX_NUM_BATCHED_TOKENS": "48",
    }, attention_backend="cpu-int8kv")
    cluster.start()
    try:
        yield cluster, model_dir, prompts
    finally:
        cluster.stop()


def test_int8_cache_serves_within_the_top_k_through_preemption_and_frees_every_block(served):
    cluster, model_dir, prompts = served
    before = engine_stats(cluster)
    responses = complete_all(cluster, model_dir.name, prompts, MAX_TOKENS)
    check_within_reference_top_k(model_dir, prompts, [r.choices[0].token_ids for r in responses], TOP_K,
                                 MIN_ARGMAX_SHARE, MAX_TOKENS)
    after = engine_stats(cluster)
    assert after["num_preemptions"] > before["num_preemptions"], "the small KV cache should force preemption"
    assert after["num_free_blocks"] == after["num_total_blocks"], after


def test_a_prefix_cache_hit_on_int8_blocks_gives_the_cold_requests_tokens(served):
    cluster, model_dir, prompts = served
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = prompts[0] + [5, 6, 7]
    runs = [client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True}) for _ in range(2)]
    assert runs[1].choices[0].token_ids == runs[0].choices[0].token_ids
    assert runs[1].usage.prompt_tokens_details.cached_tokens >= 48  # whole 16-token blocks came from the cache
