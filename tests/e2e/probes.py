"""What the end-to-end tests poll and send: a frontend's /health and /stats, a service's gRPC
health, a bounded wait for a condition (a TimeoutError naming what did not happen), and greedy
completions sent all at once."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_status(cluster) -> int:
    """The HTTP status of the cluster's frontend /health."""
    try:
        with urllib.request.urlopen(cluster.base_url + "/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def grpc_serving(addr: str) -> bool:
    """Whether the gRPC server at `addr` (no credentials) reports SERVING."""
    with grpc.insecure_channel(addr) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.1f} s")
        time.sleep(0.05)


def engine_stats(cluster) -> dict:
    """The frontend's /stats (the engine's counters)."""
    with urllib.request.urlopen(cluster.base_url + "/stats", timeout=5) as resp:
        return json.load(resp)


def complete_all(cluster, model_name: str, prompts: list[list[int]], max_tokens: int) -> list:
    """Greedy completions of every prompt (token ids), sent concurrently, EOS ignored."""
    import openai

    async def run():
        client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[
                client.completions.create(model=model_name, prompt=p, max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
                for p in prompts])
        finally:
            await client.close()

    return asyncio.run(run())
