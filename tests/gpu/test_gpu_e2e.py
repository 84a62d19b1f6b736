"""End to end with `--device cuda`: the three services on the embedded model, greedy tokens
against transformers on the CPU (float32 on both sides), one by one and concurrently (mixed
prefill/decode batches through the CUDA kernels)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from tests.e2e.cluster import SpindleCluster
from tests.e2e.parity import assert_greedy_match
from tests.openai_schema import acreate
from tests.e2e.test_default_model import MAX_TOKENS, PROMPTS, chat_ids, model, references  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_cluster(tmp_path_factory):
    env = {"SPINDLE_DEVICE": "cuda", "SPINDLE_DTYPE": "float32", "SPINDLE_MAX_MODEL_LEN": "2048",
           "SPINDLE_GPU_MEMORY_UTILIZATION": "0.5"}
    c = SpindleCluster(tmp_path_factory.mktemp("logs"), env=env, attention_backend="cupy")
    try:
        yield c.start()
    finally:
        c.stop()


def test_greedy_parity_on_cuda(cuda_cluster, model, references):
    client = openai.OpenAI(base_url=cuda_cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt, ref in zip(PROMPTS, references):
        assert_greedy_match(chat_ids(client, model, prompt), ref, f"cuda: {prompt}")
    with urllib.request.urlopen(cuda_cluster.base_url + "/stats", timeout=10) as resp:
        stats = json.load(resp)
    assert (stats["device"], stats["attention_backend"]) == ("cuda", "cupy"), stats


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
