"""Test doubles for the public edge: the app and the gRPC server built as `FrontendServer` builds them
(API keys, body limit, /metrics), a gated engine, and a raw HTTP/1.1 exchange for bodies a client
library would always send whole."""
from __future__ import annotations

import asyncio
import json
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator

import grpc
from aiohttp.test_utils import TestClient, TestServer

from services.common.grpc_server import GrpcServer
from services.common.pb import generate_pb2_grpc
from services.frontend.api_keys import ApiKeyInterceptor, ApiKeys
from services.frontend.app import create_app
from services.frontend.grpc_service import SERVICE_NAME, GenerateServicer
from services.frontend.observability import FrontendObserver, install
from services.frontend.public_edge import EdgeConfig
from services.frontend.serving_engine import OpenAIServing, ServerState, ServingModel
from tests.frontend.fakes import FakeEngineClient, serving_model


class GatedEngine(FakeEngineClient):
    """The scripted engine, holding each request's last output until `release` is set."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.release = asyncio.Event()

    async def generate(self, request: Any, final_only: bool = False, stream_interval: int = 1) -> AsyncIterator[Any]:
        async with aclosing(super().generate(request, final_only, stream_interval)) as outputs:
            async for output in outputs:
                if output.finished:
                    await self.release.wait()
                yield output


@asynccontextmanager
async def edge_client(engine: FakeEngineClient, edge: EdgeConfig = EdgeConfig(),
                      model: ServingModel | None = None) -> AsyncIterator[TestClient]:
    """The HTTP app with `edge`'s guards and /metrics, as the frontend serves it."""
    model = model or serving_model(engine.tokenizer)
    app = create_app(engine, model, ServerState(), edge=edge)
    install(app, FrontendObserver(engine, model.name))
    async with TestClient(TestServer(app)) as client:
        yield client


@asynccontextmanager
async def edge_grpc(engine: FakeEngineClient, keys: tuple[str, ...] = (), model: ServingModel | None = None,
                    max_receive_message_bytes: int | None = None) -> AsyncIterator[str]:
    """The public gRPC server with the API key interceptor; yields its address."""
    api_keys = ApiKeys(keys)
    extra = {} if max_receive_message_bytes is None else {"max_receive_message_bytes": max_receive_message_bytes}
    server = GrpcServer("127.0.0.1:0", [SERVICE_NAME], [ApiKeyInterceptor(api_keys)], **extra)
    serving = OpenAIServing(engine, model or serving_model(engine.tokenizer), ServerState())
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(serving, api_keys), server.server)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


@asynccontextmanager
async def stub_at(address: str) -> AsyncIterator[generate_pb2_grpc.GenerateServiceStub]:
    """A stub on a connection of its own (channels in one process share connections unless told not
    to), so a separate caller when there are no keys, as a client in another process is."""
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list:
    """The remaining responses of a call already read with `read()` (the two styles do not mix)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 response: status, headers (lower-case names), JSON body (by Content-Length)."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, json.loads(body)
