"""The frontend's public edge on the three services and the embedded default model.

One cluster with two API keys and the default 16 MiB body limit serves the module: no key, a wrong key, the
right key on HTTP and gRPC (/health, gRPC health and, without --protect-metrics, /metrics stay
open); a cross-client Abort is NOT_FOUND and the victim's greedy stream ends exactly as it does
alone; a 20 MiB body is 413 before it is sent; a 5 MiB prompt being tokenized neither pauses
another stream nor /health for a second; a lone surrogate or JSON nested 10,000 deep is 400.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.cluster import SpindleCluster
from tests.frontend.edge_fakes import read_response
from tests.openai_schema import validate

KEY, OTHER_KEY = "sk-e2e-first-5d1a", "sk-e2e-second-93c0"
MiB = 2**20
MAX_PAUSE_S = 1.0
FINISH = generate_pb2.GenerateResponse.FinishReason


class KeyedCluster(SpindleCluster):
    """Readiness through /health, which needs no key (the base class also reads /stats, which does)."""

    def start(self, timeout_s: float = 300) -> "KeyedCluster":
        for name in ("worker", "scheduler", "frontend"):
            self.start_service(name)
        self.wait_healthy(timeout_s)
        return self


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = KeyedCluster(tmp_path_factory.mktemp("logs"), env={
        "SPINDLE_API_KEY": f"{KEY},{OTHER_KEY}",  # the default body limit (16 MiB) stands
        "SPINDLE_KV_CACHE_BYTES": str(256 * MiB), "SPINDLE_MAX_MODEL_LEN": "2048",
    })
    try:
        yield c.start()
    finally:
        c.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def greedy(request_id: str = "", text: str = "The capital of France is", max_tokens: int = 48):
    params = generate_pb2.GenerateRequest.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return generate_pb2.GenerateRequest(request_id=request_id, text=text, sampling_params=params)


def channel(cluster) -> grpc.aio.Channel:
    """A connection of its own: a separate client."""
    return grpc.aio.insecure_channel(cluster.frontend_grpc_addr, options=[("grpc.use_local_subchannel_pool", 1)])


def test_http_needs_a_key_but_health_and_metrics_are_open(cluster):
    async def scenario():
        body = {"prompt": "The capital of France is", "max_tokens": 4}
        async with aiohttp.ClientSession(cluster.base_url) as session:
            results = {}
            for name, headers in (("none", {}), ("wrong", auth("sk-wrong")), ("right", auth(OTHER_KEY))):
                async with session.post("/v1/completions", json=body, headers=headers) as r:
                    results[name] = (r.status, await r.json())
            for path in ("/health", "/metrics", "/stats"):
                async with session.get(path) as r:
                    results[path] = r.status
            async with session.get("/stats", headers=auth(KEY)) as r:
                results["stats-keyed"] = r.status
        return results

    results = asyncio.run(scenario())
    for name in ("none", "wrong"):
        status, payload = results[name]
        assert status == 401
        validate(payload, "ErrorResponse")
        assert payload["error"]["code"] == "invalid_api_key"
    status, payload = results["right"]
    assert status == 200 and payload["usage"]["completion_tokens"] == 4, payload
    assert (results["/health"], results["/metrics"], results["/stats"], results["stats-keyed"]) == (200, 200, 401, 200)


def test_grpc_needs_a_key_but_health_is_open(cluster):
    async def scenario():
        async with channel(cluster) as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            codes = []
            for metadata in ((), md("sk-wrong")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Generate(greedy(max_tokens=4), metadata=metadata).read()
                codes.append(info.value.code())
            responses = [r async for r in stub.Generate(greedy(max_tokens=4), metadata=md(KEY))]
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        return codes, responses, health

    codes, responses, health = asyncio.run(scenario())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert sum(len(r.token_ids) for r in responses) == 4 and responses[-1].finish_reason == FINISH.FINISH_REASON_LENGTH
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_abort_from_another_client_is_not_found_and_the_victim_completes(cluster):
    async def scenario():
        async with channel(cluster) as victim_ch, channel(cluster) as intruder_ch:
            victim = generate_pb2_grpc.GenerateServiceStub(victim_ch)
            intruder = generate_pb2_grpc.GenerateServiceStub(intruder_ch)
            alone = [r async for r in victim.Generate(greedy("alone"), metadata=md(KEY))]
            call = victim.Generate(greedy("victim-1"), metadata=md(KEY))
            received = [await call.read()]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await intruder.Abort(generate_pb2.AbortRequest(request_id="victim-1"), metadata=md(OTHER_KEY))
            while (response := await call.read()) is not grpc.aio.EOF:
                received.append(response)
        return alone, received, refused.value

    alone, received, refused = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    ids = [t for r in received for t in r.token_ids]
    assert ids == [t for r in alone for t in r.token_ids] and len(ids) == 48
    assert received[-1].finish_reason == FINISH.FINISH_REASON_LENGTH
    assert all(r.request_id == "victim-1" for r in received)


@pytest.mark.parametrize("headers, status", [(auth(KEY), 413), ({}, 401)])
def test_a_20_mib_body_is_refused_before_it_is_sent(cluster, headers, status):
    async def scenario():
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.http_port)
        try:
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {20 * MiB}\r\n{head}\r\n").encode() + b'{"messages": [')
            await writer.drain()
            return await asyncio.wait_for(read_response(reader), timeout=10)  # the body never comes
        finally:
            writer.close()

    got, _, payload = asyncio.run(scenario())
    assert got == status
    validate(payload, "ErrorResponse")


def test_a_5_mib_prompt_does_not_pause_another_stream_or_health(cluster):
    rng = random.Random(0)
    words = ["hello", "world", "the", "capital", "of", "France", "is", "Paris", "日本語", "😀"]
    text = " ".join(rng.choice(words) for _ in range(MiB))[: 5 * MiB]
    large_body = json.dumps({"messages": [{"role": "user", "content": text}]})

    async def scenario():
        async with channel(cluster) as ch, aiohttp.ClientSession(cluster.base_url) as session:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            call = stub.Generate(greedy(max_tokens=1500), metadata=md(KEY))
            arrivals: list[float] = []

            async def read_stream():
                while await call.read() is not grpc.aio.EOF:
                    arrivals.append(time.perf_counter())

            reader = asyncio.create_task(read_stream())
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)

            async def post_large():
                async with session.post("/v1/chat/completions", data=large_body,
                                        headers={**auth(KEY), "Content-Type": "application/json"}) as r:
                    return r.status, await r.json()

            large = asyncio.create_task(post_large())
            start, latencies = time.perf_counter(), []
            while not large.done():
                t = time.perf_counter()
                async with session.get("/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    assert r.status == 200
                latencies.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)
            end = time.perf_counter()
            result = await large
            call.cancel()
            reader.cancel()
            return result, arrivals, start, end, latencies

    (status, payload), arrivals, start, end, latencies = asyncio.run(scenario())
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    around = [t for t in arrivals if t < start][-1:] + [t for t in arrivals if t >= start]
    around = [t for t in around if t <= end] + [t for t in around if t > end][:1]
    gaps = [b - a for a, b in zip(around, around[1:])]
    assert max(gaps) < MAX_PAUSE_S, f"the stream paused {max(gaps):.2f} s"
    assert max(latencies) < MAX_PAUSE_S, f"/health took {max(latencies):.2f} s"
    assert len(gaps) >= 5 and len(latencies) >= 5  # the stream and the probes ran during the tokenization


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "Hi \ud800"}]}'),
    ("/v1/completions", r'{"prompt": "\udfff", "max_tokens": 2}'),
    ("/tokenize", r'{"prompt": "a\ud800b"}'),
    ("/detokenize", r'{"tokens": [1], "user": "\ud800"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "x": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    ("/v1/completions", '{"a": ' * 10_000 + "1" + "}" * 10_000),
    ("/tokenize", '{"prompt": "Hi", "x": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    ("/detokenize", '{"tokens": [1], "x": ' + "[" * 10_000 + "]" * 10_000 + "}"),
])
def test_surrogates_and_deep_nesting_are_400(cluster, path, body):
    async def scenario():
        async with aiohttp.ClientSession(cluster.base_url) as session:
            async with session.post(path, data=body.encode(),
                                    headers={**auth(KEY), "Content-Type": "application/json"}) as r:
                return r.status, await r.json()

    status, payload = asyncio.run(scenario())
    assert status == 400, payload
    validate(payload, "ErrorResponse")
    assert "surrogate" in payload["error"]["message"] or "levels deep" in payload["error"]["message"]
