"""Calls the end-to-end tests make to a running cluster, and what they share about the default model."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import openai

EOS = 2  # SmolLM2's <|im_end|>
BLOCK_SIZE = 16  # the worker's default KV block

# Sampling knobs the openai client takes as arguments; the rest (vLLM's) travel in `extra_body`.
_OPENAI_ARGS = {"n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stop",
                "logprobs", "top_logprobs", "echo", "stream_options"}


def split_openai_args(kwargs: dict) -> dict:
    extra = {k: v for k, v in kwargs.items() if k not in _OPENAI_ARGS}
    return {**{k: v for k, v in kwargs.items() if k in _OPENAI_ARGS}, "extra_body": extra}


def template_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The chat prompt as transformers templates and tokenizes it (the oracle for our prompt ids)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_text(chunks: list[dict]) -> str:
    """The content of streamed chat chunks (as sent), joined."""
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def gather(cluster: Any, calls: list) -> list:
    """Runs `calls` (functions of an AsyncOpenAI client) at once, so the engine batches them."""
    async def run():
        async with openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*[call(aclient) for call in calls])

    return asyncio.run(run())


def get_json(cluster: Any, path: str) -> dict:
    with urllib.request.urlopen(cluster.base_url + path, timeout=30) as resp:
        return json.load(resp)


def post_json(cluster: Any, path: str, body: Any) -> tuple[int, dict]:
    """POSTs a JSON body (bytes are sent as they are); the status and the JSON answer, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(cluster.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


# Two tools with bounded argument schemas, for the tool-calling tests (ours and the gateway's).
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": ADD}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def openai_client(cluster) -> "openai.OpenAI":
    """The official client on a cluster's HTTP API, without retries (a failure must show)."""
    import openai

    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
