"""The frontend process: config from flags and environment, start-up, health, drain on SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
from contextlib import aclosing

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer, serve
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model

CHAT_BODY = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}


def test_config_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("SPINDLE_FRONTEND_GRPC_ADDR", "0.0.0.0:6000")
    monkeypatch.setenv("SPINDLE_SCHEDULER_ADDR", "sched:7000")
    config = FrontendConfig.from_args(["--http-port", "9000", "--max-model-len", "512", "--served-model-name", "m"])
    assert (config.http_host, config.http_port, config.grpc_addr) == ("127.0.0.1", 9000, "0.0.0.0:6000")
    assert (config.scheduler_addr, config.max_model_len, config.served_model_name) == ("sched:7000", 512, "m")
    assert config.model is None and config.shutdown_timeout_s == 30.0
    with pytest.raises(ValueError):
        FrontendConfig(scheduler_addr="nocolon")
    with pytest.raises(Exception):
        config.http_port = 1  # frozen


def _config(shutdown_timeout_s: float = 5.0, **fields) -> FrontendConfig:
    return FrontendConfig(http_port=0, grpc_addr="127.0.0.1:0", shutdown_timeout_s=shutdown_timeout_s, **fields)


async def _grpc_health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status


async def _until(check, what: str, timeout_s: float = 10.0) -> None:
    """Awaits `check()` until it is true; raises once the deadline has passed."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        await asyncio.sleep(0.01)


class HeldEngineClient(FakeEngineClient):
    """Sets `arrived` when a request reaches it, yields the first output, then holds the rest of the
    reply until `release` is set: the request is in flight for exactly as long as the test says."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def generate(self, request, final_only=False, stream_interval=1):
        self.arrived.set()
        num_sent = 0
        async with aclosing(super().generate(request, final_only, stream_interval)) as outputs:
            async for output in outputs:
                if num_sent == 1:
                    await self.release.wait()
                num_sent += 1
                yield output


def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones():
    async def scenario():
        engine = HeldEngineClient(make_tokenizer(), "word " * 20)
        # A timeout far above the test's own length: the request is released, never timed out.
        frontend = FrontendServer(_config(shutdown_timeout_s=120.0), engine_client=engine,
                                  model=serving_model(engine.tokenizer))
        await frontend.start()
        base = f"http://127.0.0.1:{frontend.http_port}"
        async with aiohttp.ClientSession() as session:
            async def health_is(status: int) -> bool:
                return (await session.get(f"{base}/health")).status == status

            async def grpc_health_is(status: int) -> bool:
                return await _grpc_health(frontend.grpc_port) == status

            assert await health_is(200)
            # gRPC health starts NOT_SERVING; the readiness follower turns it SERVING.
            await _until(lambda: grpc_health_is(health_pb2.HealthCheckResponse.SERVING), "gRPC health SERVING")
            in_flight = await session.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            await asyncio.wait_for(engine.arrived.wait(), 10)
            first_line = await in_flight.content.readline()
            stopping = asyncio.create_task(frontend.stop())
            await _until(lambda: health_is(503), "/health 503 while draining")
            await _until(lambda: grpc_health_is(health_pb2.HealthCheckResponse.NOT_SERVING),
                         "gRPC health NOT_SERVING while draining")
            refused = await session.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            # The refusal came while the first request was held in flight, and never reached the engine.
            held = (frontend.state.num_inflight, stopping.done(), len(engine.requests))
            engine.release.set()
            body = await in_flight.read()
            await asyncio.wait_for(stopping, 10)
        return first_line, refused.status, held, body, engine

    first_line, refused, held, body, engine = asyncio.run(scenario())
    assert first_line.startswith(b"data: {")
    assert refused == 503
    assert held == (1, False, 1)
    assert body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"stop"' in body
    assert engine.aborted == []


def test_sigterm_drains_and_serve_returns_zero():
    engine = FakeEngineClient(make_tokenizer())
    engine.is_closed = False

    async def close():
        engine.is_closed = True

    engine.close = close

    async def scenario():
        frontend = FrontendServer(_config(), engine_client=engine, model=serving_model(engine.tokenizer))
        started = asyncio.Event()
        start = frontend.start

        async def start_then_signal() -> None:
            await start()
            started.set()

        frontend.start = start_then_signal
        task = asyncio.create_task(serve(frontend.config, frontend))
        await asyncio.wait_for(started.wait(), 10)
        os.kill(os.getpid(), signal.SIGTERM)  # caught by the loop's handler, not the default one
        return await asyncio.wait_for(task, 10), frontend.state.is_draining

    assert asyncio.run(scenario()) == (0, True)
    assert engine.is_closed
