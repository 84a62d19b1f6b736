"""The frontend process: config from flags and environment, start-up, health, drain on SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal

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


def _config(**fields) -> FrontendConfig:
    return FrontendConfig(http_port=0, grpc_addr="127.0.0.1:0", shutdown_timeout_s=5.0, **fields)


async def _grpc_health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status


def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones():
    async def scenario():
        engine = FakeEngineClient(make_tokenizer(), "word " * 20, step_delay_s=0.02)
        frontend = FrontendServer(_config(), engine_client=engine, model=serving_model(engine.tokenizer))
        await frontend.start()
        base = f"http://127.0.0.1:{frontend.http_port}"
        async with aiohttp.ClientSession() as session:
            assert (await session.get(f"{base}/health")).status == 200
            await asyncio.sleep(0.05)  # the readiness follower's first poll
            serving_before = await _grpc_health(frontend.grpc_port)
            in_flight = await session.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            await in_flight.content.readline()
            stopping = asyncio.create_task(frontend.stop())
            await asyncio.sleep(0.05)
            health_draining = (await session.get(f"{base}/health")).status
            refused = await session.post(f"{base}/v1/chat/completions", json=CHAT_BODY)
            body = await in_flight.read()
            await stopping
        return serving_before, health_draining, refused.status, body, engine

    serving_before, health_draining, refused, body, engine = asyncio.run(scenario())
    assert serving_before == health_pb2.HealthCheckResponse.SERVING
    assert health_draining == 503 and refused == 503
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
        task = asyncio.create_task(serve(frontend.config, frontend))
        while frontend.grpc_port == 0 and not task.done():
            await asyncio.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)  # caught by the loop's handler, not the default one
        return await asyncio.wait_for(task, 10), frontend.state.is_draining

    assert asyncio.run(scenario()) == (0, True)
    assert engine.is_closed
