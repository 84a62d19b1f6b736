"""Tensor parallelism end to end: two worker ranks (gloo) behind one scheduler give transformers'
greedy tokens, with chunked prefill, preemption and prefix caching, and logprobs within 1e-4 of one
rank's, on a tiny random Qwen2 (4 query heads, 2 KV heads: one KV group per rank) and on the
embedded SmolLM2-135M (9 query heads, 3 KV heads: rank 0 holds 2 KV groups, rank 1 one)."""
from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.model_files import resolve_model
from tests.e2e.cluster import SMALL_ENGINE_ENV, SpindleCluster
from tests.e2e.parity import assert_greedy_match, hf_greedy
from tests.e2e.test_default_model import PROMPTS
from tests.e2e.openai_calls import template_ids
from tests.e2e.test_tiny_models import build_tiny_model

MAX_TOKENS = 24
NUM_PROMPTS = 8


def _stats(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=5) as resp:
        return json.load(resp)


def _start_all(clusters: list[SpindleCluster]) -> None:
    """Starts every cluster's services before waiting for any, so their models load side by side."""
    for cluster in clusters:
        for name in (*cluster.worker_names, "scheduler", "frontend"):
            cluster.start_service(name)
    for cluster in clusters:
        cluster.wait_healthy(300)


async def _complete_all(cluster, model_name, prompts, **kwargs):
    async with openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=300) as client:
        return await asyncio.gather(*[
            client.completions.create(model=model_name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True}, **kwargs)
            for p in prompts
        ])


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """The tiny Qwen2 served at TP=2 and at TP=1, with a KV cache small enough to preempt and a
    48-token budget that chunks every prompt."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
    rng = random.Random("tp")
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(40, 140))] for _ in range(NUM_PROMPTS)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # A rank holds 1 of the 2 KV heads: 4 KiB a block, so 40 blocks hold about 600 tokens, fewer than
    # the 8 prompts need at once.
    env = {"SPINDLE_MODEL": str(model_dir), "SPINDLE_MAX_NUM_BATCHED_TOKENS": "48"}
    tp2 = SpindleCluster(tmp_path_factory.mktemp("logs-tp2"), env={**env, "SPINDLE_KV_CACHE_BYTES": str(40 * 4096)},
                         tensor_parallel_size=2)
    tp1 = SpindleCluster(tmp_path_factory.mktemp("logs-tp1"), env={**env, "SPINDLE_KV_CACHE_BYTES": str(40 * 8192)})
    try:
        _start_all([tp2, tp1])
        yield tp2, tp1, model_dir.name, prompts, references
    finally:
        tp2.stop()
        tp1.stop()


def test_tp2_matches_transformers_with_chunking_preemption_and_prefix_caching(tiny_qwen2):
    tp2, tp1, model_name, prompts, references = tiny_qwen2
    # Each rank's half-size cache holds as many blocks as one rank's full-size cache.
    assert _stats(tp2)["num_total_blocks"] == _stats(tp1)["num_total_blocks"]
    before = _stats(tp2)
    responses = asyncio.run(_complete_all(tp2, model_name, prompts))
    for i, (resp, ref) in enumerate(zip(responses, references)):
        assert_greedy_match(resp.choices[0].token_ids, ref, f"prompt {i}")
    after = _stats(tp2)
    assert after["num_preemptions"] > before["num_preemptions"], "the small KV cache should force preemption"
    # One prompt twice on the idle engine: the second finds the first's full blocks in the prefix cache.
    for attempt in ("first", "prefix-cached"):
        resp, = asyncio.run(_complete_all(tp2, model_name, prompts[:1]))
        assert_greedy_match(resp.choices[0].token_ids, references[0], f"{attempt} prompt 0")
    last = _stats(tp2)
    assert last["prefix_cache_hits"] >= after["prefix_cache_hits"] + 16 * ((len(prompts[0]) - 1) // 16), \
        "the repeated prompt should hit the prefix cache"
    assert last["num_free_blocks"] == last["num_total_blocks"], last


def test_tp2_logprobs_within_1e_4_of_tp1(tiny_qwen2):
    tp2, tp1, model_name, prompts, _ = tiny_qwen2
    ours, theirs = (asyncio.run(_complete_all(c, model_name, prompts[:4], logprobs=3)) for c in (tp2, tp1))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        a_lp, b_lp = a.choices[0].logprobs, b.choices[0].logprobs
        assert a.choices[0].token_ids == b.choices[0].token_ids, i
        assert max(abs(x - y) for x, y in zip(a_lp.token_logprobs, b_lp.token_logprobs, strict=True)) < 1e-4, i
        for x, y in zip(a_lp.top_logprobs, b_lp.top_logprobs, strict=True):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-4, i


@pytest.fixture(scope="module")
def smollm2_tp2(tmp_path_factory):
    model = resolve_model(None, None)
    cluster = SpindleCluster(tmp_path_factory.mktemp("logs-smollm2-tp2"), env=SMALL_ENGINE_ENV, tensor_parallel_size=2)
    try:
        yield cluster.start(), model
    finally:
        cluster.stop()


def _references(model, prompts: list[str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model.path))
    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32).eval()
    return [hf_greedy(hf, template_ids(tokenizer, [{"role": "user", "content": p}]), MAX_TOKENS) for p in prompts]


async def _chat_all(cluster, model, prompts: list[str]):
    async with openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=300) as client:
        return await asyncio.gather(*[
            client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
            for p in prompts
        ])


def _assert_chat_parity(cluster, model, prompts: list[str]) -> None:
    for prompt, ref, resp in zip(prompts, _references(model, prompts), asyncio.run(_chat_all(cluster, model, prompts))):
        assert_greedy_match(resp.choices[0].token_ids, ref, prompt)


def test_smollm2_tp2_chat_matches_transformers_on_the_eight_prompts(smollm2_tp2):
    cluster, model = smollm2_tp2
    _assert_chat_parity(cluster, model, PROMPTS)
