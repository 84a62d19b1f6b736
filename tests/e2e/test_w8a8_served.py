"""The three services with `SPINDLE_QUANTIZATION=w8a8` on a tiny random Llama: concurrent requests
whose prefill chunks and batched decodes multiply on W8A8 (more than 16 rows), their greedy tokens
within transformers' float32 top 3 by teacher forcing (the documented agreement of
tests/worker/test_w8a8.py), every block back afterwards, and the worker's load summary naming the
mode."""
from __future__ import annotations

import random

import pytest

from services.worker.config import cpu_has_int8_dot
from services.worker.layers.w8a8 import int_mm_is_exact
from tests.e2e.cluster import SpindleCluster
from tests.e2e.probes import complete_all, engine_stats
from tests.e2e.test_tiny_models import build_tiny_model
from tests.top_k_agreement import check_within_reference_top_k

MAX_TOKENS = 16
NUM_PROMPTS = 24  # more than 16 decode rows at once
TOP_K = 3
MIN_ARGMAX_SHARE = 0.9

pytestmark = pytest.mark.skipif(not (cpu_has_int8_dot() and int_mm_is_exact()),
                                reason="no VNNI/AMX-INT8 on this CPU: the worker refuses w8a8")


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


def test_w8a8_serves_within_the_top_k_and_frees_every_block(served):
    cluster, model_dir, prompts, log_dir = served
    assert "activations quantized per row above (W8A8" in (log_dir / "worker.log").read_text()
    responses = complete_all(cluster, model_dir.name, prompts, MAX_TOKENS)
    check_within_reference_top_k(model_dir, prompts, [r.choices[0].token_ids for r in responses], TOP_K,
                                 MIN_ARGMAX_SHARE, MAX_TOKENS)
    after = engine_stats(cluster)
    assert after["num_free_blocks"] == after["num_total_blocks"], after
