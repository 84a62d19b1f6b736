"""The WorkerService gRPC server.

The model runs in ONE dedicated thread (a single-worker executor): steps are serialised, and the
event loop stays free for health checks and the stream's I/O. Protobuf decoding and encoding
happen in that thread too, which takes a stream's queued steps one after another
(step_pipeline.py). A step that raises is answered with `error_message` rather than
breaking the stream, until `--worker-max-consecutive-failed-steps` steps in a row have failed: then
the worker is broken (a sticky device fault fails every step while every probe would pass). Health
turns NOT_SERVING, the step stream ends with UNAVAILABLE and the worker refuses every new one, so
the scheduler reports its engine lost and the liveness probe restarts the worker.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import worker_codec as codec
from services.common.gc_tuning import freeze_startup_objects
from services.common.grpc_server import GrpcServer, install_stop_signals
from services.common.metrics_server import MetricsServer, listen_host
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.telemetry import Tracing, server_interceptors, setup_tracing
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.parallel.process_group import CollectiveError
from services.worker.scheduler_lease import SchedulerLease
from services.worker.step_pipeline import StepPipeline
from services.worker.step_watchdog import StepWatchdog
from services.worker.tracing import WorkerTracer
from services.worker.worker import Worker

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker: Worker, executor: ThreadPoolExecutor, watchdog: StepWatchdog | None = None,
                 max_consecutive_failed_steps: int = 0, on_broken=None):
        """`on_broken`: an async callback run once when the worker breaks (the server turns health
        NOT_SERVING)."""
        self.worker = worker
        self.watchdog = watchdog
        self.executor = executor
        self.is_ready = False
        self.max_consecutive_failed_steps = max_consecutive_failed_steps
        self.num_consecutive_failed_steps = 0  # written by the model thread only
        self.is_broken = False
        self._on_broken = on_broken
        # Observability hooks (services/worker/metrics.py, tracing.py); tracer is None when tracing is off.
        self.metrics = WorkerMetrics()
        self.tracer: WorkerTracer | None = None
        self.lease = SchedulerLease()  # one scheduler at a time (services/worker/scheduler_lease.py)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.is_broken:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._broken_message())
        if not self.is_ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading the model")

    def _broken_message(self) -> str:
        return (f"worker broken: {self.num_consecutive_failed_steps} steps failed in a row "
                "(--worker-max-consecutive-failed-steps); it needs a restart")

    async def DescribeKVCache(self, request, context):
        await self._require_ready(context)
        return codec.kv_cache_spec_to_pb(self.worker.describe_kv_cache())

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, reason: str) -> None:
        logger.warning("refused %s from %s: %s", method, context.peer(), reason)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)

    async def InitializeKVCache(self, request, context):
        await self._require_ready(context)
        refusal = self.lease.begin_initialize()
        if refusal is not None:
            await self._refuse(context, "InitializeKVCache", refusal)
        is_ok = False
        try:
            response = await self._initialize_kv_cache(request, context)
            is_ok = True
            return response
        finally:
            self.lease.end_initialize(context.peer(), is_ok)

    async def _initialize_kv_cache(self, request, context):
        try:
            num_blocks, num_bytes = await self._run(
                self.worker.initialize_kv_cache, request.num_blocks, request.tensor_parallel_rendezvous_addr,
                request.tensor_parallel_generation)
        except CollectiveError as exc:  # the other ranks did not all arrive: the scheduler retries
            logger.error("InitializeKVCache: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor parallel rendezvous failed: {exc}")
        except (ValueError, RuntimeError, MemoryError) as exc:
            logger.exception("InitializeKVCache(%d) failed", request.num_blocks)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot allocate the KV cache: {exc}")
        if self.tracer is not None:
            await self._run(self.tracer.reset)  # the runner dropped every request
        return worker_pb2.InitializeKVCacheResponse(num_blocks=num_blocks, kv_cache_bytes=num_bytes)

    async def ExecuteModel(self, request_iterator, context):
        await self._require_ready(context)
        stream_id, refusal = self.lease.begin_stream(context.peer())
        if refusal is not None:
            await self._refuse(context, "ExecuteModel", refusal)
        # However the stream ends: a dropped connection may cancel this generator where no finally runs.
        context.add_done_callback(lambda _: self.lease.end_stream(stream_id))
        steps = codec.StepDecoder()  # this stream's end: each step may refer to the one before
        pipeline = StepPipeline(lambda request: self._step(request, steps), self.executor, self._has_failed_too_often)
        reader = asyncio.ensure_future(self._read_steps(request_iterator, pipeline))
        try:
            async for response in pipeline.outputs():
                yield response
                if not self.is_broken and self._has_failed_too_often():
                    self.is_broken = True
                    logger.error("%s: health NOT_SERVING", self._broken_message())
                    if self._on_broken is not None:
                        await self._on_broken()
                if self.is_broken:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, self._broken_message())
        finally:
            reader.cancel()
            pipeline.close()

    @staticmethod
    async def _read_steps(request_iterator, pipeline: StepPipeline) -> None:
        try:
            async for request in request_iterator:
                pipeline.submit(request)
        finally:
            pipeline.finish()

    def _has_failed_too_often(self) -> bool:
        return bool(self.max_consecutive_failed_steps) \
            and self.num_consecutive_failed_steps >= self.max_consecutive_failed_steps

    def _step(self, request: worker_pb2.ExecuteModelRequest, steps: codec.StepDecoder
              ) -> worker_pb2.ExecuteModelResponse:
        step_id = request.scheduler_output.step_id
        start_s = time.time()
        if self.watchdog is not None:
            self.watchdog.step_started(step_id)
        has_run = False
        try:
            scheduler_output = steps.decode(request.scheduler_output)
            has_run = True  # a step refused at decoding (sent against a failed one) is no device fault
            output = self.worker.execute_model(scheduler_output)
            self.metrics.on_step(scheduler_output, output)
            if self.tracer is not None:
                self.tracer.on_step(scheduler_output, output, start_s, time.time())
            self.num_consecutive_failed_steps = 0
            return steps.encode_output(output)
        except Exception as exc:  # noqa: BLE001 - any failure is reported to the scheduler, not raised
            logger.exception("step %d failed", step_id)
            # A collective that failed is a peer rank's death or hang, not this device's fault.
            if has_run and not isinstance(exc, CollectiveError):
                self.num_consecutive_failed_steps += 1
            self.metrics.on_step_failed()
            return steps.encode_failure(step_id, f"worker step {step_id} failed: {type(exc).__name__}: {exc}")
        finally:
            if self.watchdog is not None:
                self.watchdog.step_ended()


class WorkerServer:
    """Starts serving health (NOT_SERVING) at once, then loads the model and turns SERVING."""

    def __init__(self, config: WorkerConfig, worker: Worker | None = None, tracing: Tracing | None = None):
        self.config = config
        self.worker = worker or Worker(config)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        self.watchdog = StepWatchdog(config.step_timeout_s, self._set_serving,
                                     lambda: self.servicer.is_ready and not self.servicer.is_broken)
        self.servicer = WorkerServicer(self.worker, self.executor, self.watchdog,
                                       config.max_consecutive_failed_steps, lambda: self._set_serving(False))
        self._watchdog_task: asyncio.Task | None = None
        self.tracing = tracing
        self.servicer.tracer = WorkerTracer(tracing) if tracing is not None else None
        self.metrics_server = MetricsServer(self.servicer.metrics.registry, listen_host(config.worker_addr),
                                            config.telemetry.metrics_port)
        self.grpc = GrpcServer(config.worker_addr, [SERVICE_NAME], server_interceptors(tracing), auth=config.auth)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self.servicer, self.grpc.server)

    @property
    def address(self) -> str:
        host = self.config.worker_addr.rsplit(":", 1)[0]
        return f"{host}:{self.grpc.port}"

    async def _set_serving(self, is_serving: bool) -> None:
        await self.grpc.set_serving(is_serving)

    async def start(self) -> None:
        await self.metrics_server.start()
        await self.grpc.start()
        self._watchdog_task = asyncio.ensure_future(self.watchdog.run())
        logger.info("worker listening on %s (NOT_SERVING until the model is loaded)", self.address)

    async def load(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.executor, self.worker.load_model)
        self.servicer.is_ready = True
        await self.grpc.set_serving(True)
        spec = self.worker.describe_kv_cache()
        self.servicer.metrics.set_model_name(spec.model_name)
        logger.info(
            "worker ready on %s (model %s, dtype %s, device %s, %d KV blocks of %d tokens, max_model_len %d)",
            self.address, spec.model_name, spec.dtype, spec.device, spec.num_blocks, spec.block_size,
            spec.max_model_len,
        )

    async def stop(self, grace_s: float) -> None:
        self.servicer.is_ready = False
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        await self.grpc.stop(grace_s)
        self.executor.shutdown(wait=False, cancel_futures=True)
        await self.metrics_server.stop()
        if self.tracing is not None:
            self.tracing.shutdown()  # exports the spans still queued


async def serve(config: WorkerConfig) -> int:
    """Runs until SIGTERM/SIGINT; returns the process exit code."""
    server = WorkerServer(config, tracing=setup_tracing("spindle-worker", config.telemetry.otlp_traces_endpoint))
    stop = asyncio.Event()
    install_stop_signals(stop)
    await server.start()
    load = asyncio.ensure_future(server.load())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done() and load.exception() is not None:
        exc = load.exception()
        # A bad flag or path needs its message, not a traceback.
        is_user_error = isinstance(exc, (FileNotFoundError, ValueError))
        logger.error("worker failed to start: %s", exc, exc_info=None if is_user_error else exc)
        code = 1
    elif not stop.is_set():
        freeze_startup_objects()  # the model's modules live for good
        await stopped
    logger.info("worker stopping (grace %.0f s)", config.shutdown_timeout)
    await server.stop(config.shutdown_timeout)
    if not load.done():
        load.cancel()
    return code
