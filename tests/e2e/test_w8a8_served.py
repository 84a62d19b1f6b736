"""The three services with `SPINDLE_QUANTIZATION=w8a8` on a tiny random Llama: concurrent requests
whose prefill chunks and batched decodes multiply on W8A8 (more than 16 rows), their greedy tokens
within transformers' float32 top 3 by teacher forcing (the documented agreement of
tests/worker/test_w8a8.py), every block back afterwards, and the worker's load summary naming the
mode."""
from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.worker.layers.w8a8 import int_mm_is_exact
from tests.e2e.cluster import SpindleCluster
from tests.e2e.test_tiny_models import build_tiny_model

MAX_TOKENS = 16
NUM_PROMPTS = 24  # more than 16 decode rows at once
TOP_K = 3
MIN_ARGMAX_SHARE = 0.9

pytestmark = pytest.mark.skipif(not int_mm_is_exact(),
                                reason="torch._int_mm is not exact on this CPU (no VNNI/AMX): w8a8 refused")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
    rng = random.Random("w8a8")
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(20, 90))] for _ in range(NUM_PROMPTS)]
    log_dir = tmp_path_factory.mktemp("logs-w8a8")
    cluster = SpindleCluster(log_dir, env={"SPINDLE_MODEL": str(model_dir), "SPINDLE_QUANTIZATION": "w8a8",
                                           "SPINDLE_MAX_NUM_BATCHED_TOKENS": "256"})
    cluster.start()
    try:
        yield cluster, model_dir, prompts, log_dir
    finally:
        cluster.stop()


def _stats(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=5) as resp:
        return json.load(resp)


async def _complete_all(cluster, model_name, prompts):
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        return await asyncio.gather(*[
            client.completions.create(model=model_name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
            for p in prompts])
    finally:
        await client.close()


def test_w8a8_serves_within_the_top_k_and_frees_every_block(served):
    cluster, model_dir, prompts, log_dir = served
    assert "activations quantized per row above (W8A8" in (log_dir / "worker.log").read_text()
    responses = asyncio.run(_complete_all(cluster, model_dir.name, prompts))
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    num_tokens = num_argmax = 0
    for i, (prompt, resp) in enumerate(zip(prompts, responses)):
        tokens = resp.choices[0].token_ids
        assert len(tokens) == MAX_TOKENS
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        top = logits.topk(TOP_K, dim=-1).indices.tolist()
        assert all(t in top[j] for j, t in enumerate(tokens)), f"prompt {i}: {tokens} leaves the top {TOP_K}"
        num_argmax += sum(int(t == row[0]) for t, row in zip(tokens, top))
        num_tokens += len(tokens)
    assert num_argmax / num_tokens >= MIN_ARGMAX_SHARE, f"{num_argmax} of {num_tokens} tokens are the argmax"
    after = _stats(cluster)
    assert after["num_free_blocks"] == after["num_total_blocks"], after
