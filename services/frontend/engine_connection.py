"""One connection to a scheduler: its own channel, its Connect stream, and the requests sent on it.

The engine client sends new requests on one connection at a time. When that engine drains, or its
stream ends, the client opens another connection (its own channel, so its own TCP connection: behind
a Kubernetes Service it reaches a Ready engine), while the draining one carries its requests to their
end. Each connection owns a subchannel of its own for that reason: gRPC otherwise shares one TCP
connection among every channel to the same address, and a new channel would reach the draining
engine again.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

import grpc

from services.common import codec
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.messages import EngineInfo
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.service_auth import ServiceAuthConfig, open_channel
from services.frontend.errors import EngineError

MAX_RECONNECT_BACKOFF_S = 5.0
# gRPC's own reconnect back-off grows to 120 s by default: after a long scheduler outage the frontend
# would stay unready for up to two minutes after the scheduler is back. Capped like our retries.
SCHEDULER_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
    ("grpc.use_local_subchannel_pool", 1),
]
ENGINE_INFO_TIMEOUT_S = 5.0


class EngineConnection:
    def __init__(self, scheduler_addr: str, auth: ServiceAuthConfig, interceptors: Sequence[Any] = ()):
        self.channel = open_channel(scheduler_addr, auth, SCHEDULER_CHANNEL_OPTIONS, interceptors)
        self.stub = engine_core_pb2_grpc.EngineCoreServiceStub(self.channel)
        self.call: Any = None  # the Connect stream, once `open` returned
        self.is_draining = False  # its engine said so: no new requests go here
        self.is_closed = False
        self.request_ids: set[str] = set()  # sent here and not yet finished
        # grpc.aio allows one write in flight per call; concurrent requests take turns.
        self._write_lock = asyncio.Lock()

    async def open(self) -> EngineInfo:
        """Asks the engine for its info (refused while it drains or has no worker), then opens the
        stream; raises grpc.aio.AioRpcError if the engine cannot take requests."""
        info = await self.stub.GetEngineInfo(engine_core_pb2.GetEngineInfoRequest(), timeout=ENGINE_INFO_TIMEOUT_S,
                                             wait_for_ready=True)
        self.call = self.stub.Connect()
        return codec.engine_info_from_pb(info)

    async def write(self, message: engine_core_pb2.ConnectRequest) -> None:
        if self.call is None or self.is_closed:
            raise EngineError("not connected to the scheduler", "unavailable")
        try:
            async with self._write_lock:
                await self.call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise EngineError(f"lost the scheduler: {exc}", "unavailable") from exc

    def responses(self) -> AsyncIterator[engine_core_pb2.ConnectResponse]:
        return self.call.__aiter__()

    async def close(self) -> None:
        self.is_closed = True
        if self.call is not None:
            self.call.cancel()  # a stream we stopped reading: the scheduler drops its requests
        await self.channel.close()
