"""The HTTP fuzz (tests/http_fuzz.py, tests/openapi_strategies.py) against the three services on a
random-weight tiny Llama: every body gets a reply within the timeout, never a 5xx, an OpenAI error
object or a valid response; afterwards nothing runs and every KV block is free. Small `max_tokens`
and context keep generations short; `make test-slow` runs four times the examples, random each run.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from tests.e2e.cluster import SpindleCluster
from tests.e2e.test_tiny_models import build_tiny_model
from tests.http_fuzz import check_reply, fuzz_target
from tests.openapi_strategies import MUTATIONS, POST_ROUTES, mutated_bodies, official_bodies, served_bodies

MAX_TOKENS = 4
MAX_MODEL_LEN = 96  # the chat template alone is about 30 tokens: longer prompts are refused early
NUM_EXAMPLES = {"served": 60, "official": 30, "mutated": 10}  # mutated: per mutation
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-fuzz"), "llama")
    c = SpindleCluster(tmp_path_factory.mktemp("logs-fuzz"), env={
        "SPINDLE_MODEL": str(model_dir), "SPINDLE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "SPINDLE_KV_CACHE_BYTES": str(256 * 8192)})
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    try:
        yield c.start(), model_dir.name, vocab_size
    finally:
        c.stop()


FAMILIES = ("served", "official", *(f"mutated: {how}" for how in MUTATIONS))


def _bodies(family: str, path: str, model_name: str, vocab_size: int):
    if family == "served":
        return served_bodies(path, model_name, vocab_size, MAX_TOKENS)
    if family == "official":
        return official_bodies(path, model_name)
    return mutated_bodies(path, model_name, vocab_size, MAX_TOKENS, family.removeprefix("mutated: "))


def _fuzz(cluster, family: str, path: str, scale: int, derandomize: bool) -> None:
    c, model_name, vocab_size = cluster
    num_examples = scale * NUM_EXAMPLES[family.split(":")[0]]
    with fuzz_target(base_url=c.base_url) as target:
        @settings(max_examples=num_examples, deadline=None, derandomize=derandomize, database=None,
                  suppress_health_check=SUPPRESSED)
        @given(body=_bodies(family, path, model_name, vocab_size))
        def run(body):
            check_reply(body, target.post(body))

        run()
    stats = c.wait_for_idle()  # nothing left running, and no block held by a request that ended
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_cluster(cluster, family, path):
    _fuzz(cluster, family, path, scale=1, derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_cluster_long(cluster, family, path):
    _fuzz(cluster, family, path, scale=4, derandomize=False)
