"""`python -m services.scheduler`: the engine core service."""
from __future__ import annotations

import asyncio
import sys
import time

from services.common.grpc_server import GrpcServer, install_stop_signals
from services.common.logging_setup import setup_logging
from services.common.metrics_server import MetricsServer, listen_host
from services.common.telemetry import client_interceptors, server_interceptors, setup_tracing
from services.scheduler.config import SchedulerServiceConfig, config_from_args
from services.scheduler.engine_core import EngineCore
from services.scheduler.metrics import scheduler_registry
from services.scheduler.server import SERVICE_NAME, add_engine_core_service
from services.scheduler.tracing import SchedulerTracer
from services.scheduler.worker_client import WorkerClient


async def serve(config: SchedulerServiceConfig) -> None:
    logger = setup_logging("scheduler", config.log_level)
    tracing = setup_tracing("spindle-scheduler", config.telemetry.otlp_traces_endpoint)  # None: tracing off
    server = GrpcServer(config.scheduler_addr, [SERVICE_NAME], server_interceptors(tracing))
    loop = asyncio.get_running_loop()

    def on_health_change(serving: bool) -> None:
        loop.create_task(server.set_serving(serving))

    engine = EngineCore(config.scheduler, WorkerClient(config.worker_addr, client_interceptors(tracing)),
                        on_health_change, tracer=SchedulerTracer(tracing) if tracing is not None else None)
    add_engine_core_service(server.server, engine)
    metrics_server = MetricsServer(scheduler_registry(engine), listen_host(config.scheduler_addr),
                                   config.telemetry.metrics_port)
    await metrics_server.start()
    await server.start()
    logger.info("scheduler listening on %s, waiting for worker %s", config.scheduler_addr, config.worker_addr)

    stop = asyncio.Event()
    drain = asyncio.Event()

    def on_signal(signum: int) -> None:
        engine.is_draining = True
        loop.create_task(server.set_serving(False))
        engine.wake()

    install_stop_signals(drain, on_signal)
    engine_task = asyncio.create_task(engine.run(stop))
    await drain.wait()

    # Drain: new requests are refused; in-flight ones may finish within the shutdown timeout.
    deadline = time.monotonic() + config.shutdown_timeout_s
    while engine.num_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_unfinished_requests():
        logger.warning("shutdown timeout: aborting %d requests", engine.num_unfinished_requests())
        engine.fail_remaining("the engine shut down before the request finished")
    stop.set()
    engine.wake()
    await asyncio.sleep(0.1)  # let the last outputs reach the frontends
    engine_task.cancel()
    await server.stop(grace_s=1.0)
    await engine.worker.close()
    await metrics_server.stop()
    if tracing is not None:
        tracing.shutdown()  # exports the spans still queued
    logger.info("scheduler stopped")


def main(argv: list[str] | None = None) -> int:
    asyncio.run(serve(config_from_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
