"""`--stream-interval 4` over the three services (a tiny random Llama): a streamed response gets its
first token at once, then four tokens a chunk, then the rest with the finish, and the same text and
tokens as the full response; a request with stop strings still gets every token in its own chunk,
so that a stop string ends it at once."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.cluster import SpindleCluster
from tests.e2e.test_tiny_models import build_tiny_model

STREAM_INTERVAL = 4
MAX_TOKENS = 10
PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
    cluster = SpindleCluster(tmp_path_factory.mktemp("logs-stream-interval"), env={"SPINDLE_MODEL": str(model_dir)},
                             service_env={"frontend": {"SPINDLE_STREAM_INTERVAL": str(STREAM_INTERVAL)}})
    cluster.start()
    try:
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        yield client, model_dir.name
    finally:
        cluster.stop()


def _stream(client, model: str, **fields) -> list:
    return list(client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                          stream=True, logprobs=0, extra_body={"ignore_eos": True}, **fields))


def test_a_streamed_response_comes_every_interval_with_the_full_responses_text(served):
    client, model = served
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = _stream(client, model)
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert sizes == [1, 4, 4, 1], sizes
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert len(full.choices[0].token_ids) == MAX_TOKENS


def test_a_request_with_stop_strings_still_gets_every_token_at_once(served):
    client, model = served
    chunks = _stream(client, model, stop=["\x00never"])
    assert [len(c.choices[0].logprobs.tokens) for c in chunks] == [1] * MAX_TOKENS
