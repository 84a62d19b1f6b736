"""EngineCoreService: the gRPC face of the engine core (frontends connect here)."""
from __future__ import annotations

import asyncio
import logging

import grpc

from services.common import codec
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.scheduler.engine_core import EngineCore

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_core_pb2.DESCRIPTOR.services_by_name["EngineCoreService"].full_name


class EngineCoreServicer(engine_core_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, engine: EngineCore):
        self.engine = engine

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        """Requests and aborts arrive on the stream; one EngineCoreOutputs per step goes back."""
        client_id, queue = self.engine.register_client()
        logger.info("frontend connected (client %d, %s)", client_id, context.peer())
        reader = asyncio.create_task(self._read_requests(client_id, request_iterator))
        # The frontend closing its side ends the reader, which wakes the loop below with None: one
        # queue wait per step, no task or wait set built per step.
        reader.add_done_callback(lambda _: queue.put_nowait(None))
        # Plain outputs name their requests only when the set or order changed since the last ones.
        encoder = codec.OutputsEncoder()
        try:
            while True:
                outputs = await queue.get()
                if outputs is None:
                    break  # the frontend closed its side
                yield engine_core_pb2.ConnectResponse(outputs=encoder.encode(outputs))
        finally:
            reader.cancel()
            self.engine.unregister_client(client_id)
            logger.info("frontend disconnected (client %d)", client_id)

    async def _read_requests(self, client_id: int, request_iterator) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "add_request":
                    self.engine.add_request(client_id, codec.engine_core_request_from_pb(message.add_request))
                elif kind == "abort_requests":
                    self.engine.abort_requests(list(message.abort_requests.request_ids))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    async def GetEngineInfo(self, request, context: grpc.aio.ServicerContext):
        info = self.engine.info
        if info is None or not self.engine.is_worker_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not ready")
        return codec.engine_info_to_pb(info)

    async def GetStats(self, request, context: grpc.aio.ServicerContext):
        return engine_core_pb2.GetStatsResponse(
            scheduler_stats=codec.scheduler_stats_to_pb(self.engine.get_stats()),
            is_worker_alive=self.engine.is_worker_alive,
        )


def add_engine_core_service(server: grpc.aio.Server, engine: EngineCore) -> None:
    engine_core_pb2_grpc.add_EngineCoreServiceServicer_to_server(EngineCoreServicer(engine), server)
