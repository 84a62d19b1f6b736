"""The scheduler service: `EngineCoreService` (the gRPC face of the engine core, where frontends
connect), and `SchedulerServer`, its lifecycle, shaped as the frontend's and the worker's: start,
drain on SIGTERM, stop."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common import codec
from services.common.grpc_server import GrpcServer, install_stop_signals
from services.common.metrics_server import MetricsServer, listen_host
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.telemetry import Tracing, client_interceptors, server_interceptors, setup_tracing
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import Executor
from services.scheduler.metrics import scheduler_registry
from services.scheduler.output_router import DRAIN_NOTICE, OutputRouter
from services.scheduler.tracing import SchedulerTracer
from services.scheduler.worker_client import WorkerClient

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_core_pb2.DESCRIPTOR.services_by_name["EngineCoreService"].full_name


class EngineCoreServicer(engine_core_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, engine: EngineCore):
        self.engine = engine

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        """Requests and aborts arrive on the stream; one EngineCoreOutputs per step goes back."""
        client_id, queue = self.engine.router.register_client()
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
                if outputs is DRAIN_NOTICE:
                    yield engine_core_pb2.ConnectResponse(draining=True)
                    continue
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
                    self.engine.abort_requests(client_id, list(message.abort_requests.request_ids))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    async def GetEngineInfo(self, request, context: grpc.aio.ServicerContext):
        info = self.engine.info
        if self.engine.is_draining:  # a reconnecting frontend must pick another engine
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is draining")
        if info is None or not self.engine.is_worker_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not ready")
        return codec.engine_info_to_pb(info)

    async def ResetPrefixCache(self, request, context: grpc.aio.ServicerContext):
        return engine_core_pb2.ResetPrefixCacheResponse(done=self.engine.reset_prefix_cache())

    async def SubscribeKvEvents(self, request, context: grpc.aio.ServicerContext):
        queue = self.engine.subscribe_kv_events()
        try:
            while True:
                batch = await queue.get()
                if batch is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "the subscriber fell too far behind the KV events; subscribe again")
                yield codec.kv_event_batch_to_pb(batch)
        finally:
            self.engine.unsubscribe_kv_events(queue)

    async def GetStats(self, request, context: grpc.aio.ServicerContext):
        return engine_core_pb2.GetStatsResponse(
            scheduler_stats=codec.scheduler_stats_to_pb(self.engine.get_stats()),
            is_worker_alive=self.engine.is_worker_alive,
            is_draining=self.engine.is_draining,
        )


class SchedulerServer:
    """Serves health NOT_SERVING until the worker is connected; the engine loop runs from `start`
    to `stop`, reconnecting to the worker whenever it is lost."""

    def __init__(self, config: SchedulerServiceConfig, tracing: Tracing | None = None):
        self.config = config
        self.tracing = tracing
        self.grpc = GrpcServer(config.scheduler_addr, [SERVICE_NAME], server_interceptors(tracing), auth=config.auth)
        self.executor = Executor([WorkerClient(addr, client_interceptors(tracing), auth=config.auth)
                                  for addr in config.worker_addrs],
                                 step_timeout_s=config.worker_step_timeout_s)
        router = OutputRouter(SchedulerTracer(tracing) if tracing is not None else None)
        self.engine = EngineCore(config.scheduler, self.executor, router, self._on_health_change)
        engine_core_pb2_grpc.add_EngineCoreServiceServicer_to_server(EngineCoreServicer(self.engine), self.grpc.server)
        self.metrics_server = MetricsServer(scheduler_registry(self.engine), listen_host(config.scheduler_addr),
                                            config.telemetry.metrics_port)
        self._stop = asyncio.Event()
        self._engine_task: asyncio.Task | None = None

    def _on_health_change(self, serving: bool) -> None:
        asyncio.get_running_loop().create_task(self.grpc.set_serving(serving))

    async def start(self) -> None:
        await self.metrics_server.start()
        await self.grpc.start()
        self._engine_task = asyncio.create_task(self.engine.run(self._stop))
        logger.info("scheduler listening on %s, waiting for worker %s", self.config.scheduler_addr,
                    ", ".join(self.config.worker_addrs))

    def begin_drain(self) -> None:
        """New requests are refused from now on, the frontends are told, and health turns NOT_SERVING."""
        self.engine.begin_drain()

    async def drain(self, timeout_s: float) -> None:
        """Lets in-flight requests finish within `timeout_s`; what still runs then ends with an error."""
        engine = self.engine
        deadline = time.monotonic() + timeout_s
        while engine.num_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_unfinished_requests():
            logger.warning("shutdown timeout: aborting %d requests", engine.num_unfinished_requests())
            engine.fail_remaining("the engine shut down before the request finished")

    async def stop(self) -> None:
        self._stop.set()
        self.engine.wake()
        await asyncio.sleep(0.1)  # let the last outputs reach the frontends
        if self._engine_task is not None:
            self._engine_task.cancel()
        await self.grpc.stop(grace_s=1.0)
        await self.executor.close()
        await self.metrics_server.stop()
        if self.tracing is not None:
            self.tracing.shutdown()  # exports the spans still queued


async def serve(config: SchedulerServiceConfig) -> int:
    """Runs until SIGTERM/SIGINT, then drains; returns the process exit code."""
    server = SchedulerServer(config, setup_tracing("spindle-scheduler", config.telemetry.otlp_traces_endpoint))
    drain = asyncio.Event()
    install_stop_signals(drain, lambda signum: server.begin_drain())
    await server.start()
    await drain.wait()
    await server.drain(config.shutdown_timeout_s)
    await server.stop()
    logger.info("scheduler stopped")
    return 0
