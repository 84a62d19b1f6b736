"""The services' event loop: a coroutine runs to its result on uvloop, with grpc.aio on it."""
from __future__ import annotations

import asyncio

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import event_loop


def test_run_returns_the_coroutines_result_on_a_uvloop_loop():
    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(main()).startswith("uvloop")


def test_a_grpc_aio_server_and_channel_talk_on_it():
    async def main() -> int:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return reply.status
        finally:
            await server.stop(None)

    assert event_loop.run(main()) == health_pb2.HealthCheckResponse.SERVING
