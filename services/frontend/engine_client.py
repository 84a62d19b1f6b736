"""The frontend's connection to the engine core: one long-lived bidirectional stream.

Requests and aborts go out on the stream; one EngineCoreOutputs per engine step comes back and is
dispatched to per-request queues. A request that only wants its final output (non-streaming, no stop
strings) is not woken every step: its outputs are held here and handed over merged when it finishes,
so a step costs such a request one list extend instead of a task wake-up. A step's plain outputs
(new tokens only) arrive in columns and become objects only for requests that stream. When the
scheduler goes away, every in-flight request fails with an "unavailable" error and the client
reconnects with back-off.
"""
from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any, AsyncIterator, Sequence

import grpc

from services.common import codec
from services.common.gc_tuning import freeze_startup_objects
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.kv_events import KVEventBatch
from services.common.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    OutputExtras,
    SchedulerStats,
)
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.service_auth import NO_SERVICE_AUTH, ServiceAuthConfig, open_channel
from services.frontend.engine_protocol import StepObserver
from services.frontend.errors import EngineError

logger = logging.getLogger(__name__)

STATS_POLL_INTERVAL_S = 1.0
MAX_RECONNECT_BACKOFF_S = 5.0
# gRPC's own reconnect back-off grows to 120 s by default: after a long scheduler outage the frontend
# would stay unready for up to two minutes after the scheduler is back. Capped like our retries.
SCHEDULER_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000))]


class EngineClient:
    def __init__(self, scheduler_addr: str, interceptors: Sequence[Any] = (),
                 auth: ServiceAuthConfig = NO_SERVICE_AUTH):
        self.scheduler_addr = scheduler_addr
        self.info: EngineInfo | None = None
        self.last_stats = SchedulerStats()
        # Observability hook: sees every step's outputs (services/frontend/observability.py); set by the server.
        self.observer: StepObserver | None = None
        self._is_worker_alive = False
        # `interceptors`: the tracing interceptors when tracing is on (services/common/telemetry.py);
        # `auth`: this frontend's certificate and/or the scheduler's token (services/common/service_auth.py).
        self._channel = open_channel(scheduler_addr, auth, SCHEDULER_CHANNEL_OPTIONS, interceptors)
        self._stub = engine_core_pb2_grpc.EngineCoreServiceStub(self._channel)
        self._call = None
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        # Outputs held for final-only requests until they finish.
        self._held: dict[str, HeldOutput] = {}
        self._connected = asyncio.Event()
        # grpc.aio allows one write in flight per call; concurrent requests take turns.
        self._write_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []

    @property
    def is_ready(self) -> bool:
        return self._connected.is_set() and self._is_worker_alive and self.info is not None

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run_stream()), asyncio.create_task(self._poll_stats())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._channel.close()

    async def generate(self, request: EngineCoreRequest, final_only: bool = False
                       ) -> AsyncIterator[EngineCoreOutput]:
        """Yields the request's outputs until one finishes it; leaving early aborts the request.

        With `final_only` the outputs come merged into one, when the request finishes.
        """
        if not self.is_ready:
            raise EngineError("the engine is not ready", "unavailable")
        if request.request_id in self._queues:
            raise EngineError(f"duplicate request id {request.request_id!r}", "invalid_argument")
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        if final_only:
            self._held[request.request_id] = HeldOutput()
        finished = False
        try:
            await self._write(engine_core_pb2.ConnectRequest(add_request=codec.engine_core_request_to_pb(request)))
            while True:
                output = await queue.get()
                if output.finish_reason == FinishReason.ERROR:
                    finished = True
                    raise EngineError(output.error_message or "engine error", output.error_code or "internal")
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self._queues.pop(request.request_id, None)
            self._held.pop(request.request_id, None)
            if not finished:
                await self._abort_quietly(request.request_id)

    async def abort(self, request_id: str) -> None:
        await self._write(engine_core_pb2.ConnectRequest(
            abort_requests=engine_core_pb2.AbortRequests(request_ids=[request_id])))

    async def get_stats(self) -> tuple[SchedulerStats, bool]:
        response = await self._stub.GetStats(engine_core_pb2.GetStatsRequest(), timeout=5)
        return codec.scheduler_stats_from_pb(response.scheduler_stats), response.is_worker_alive

    async def reset_prefix_cache(self) -> bool:
        try:
            response = await self._stub.ResetPrefixCache(engine_core_pb2.ResetPrefixCacheRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise EngineError(f"the scheduler did not reset its prefix cache: {exc.details()}", "unavailable") from exc
        return response.done

    async def subscribe_kv_events(self) -> AsyncIterator[KVEventBatch]:
        call = self._stub.SubscribeKvEvents(engine_core_pb2.SubscribeKvEventsRequest())
        try:
            async for batch in call:
                yield codec.kv_event_batch_from_pb(batch)
        except grpc.aio.AioRpcError as exc:
            raise EngineError(f"the scheduler's KV event stream ended: {exc.details()}", "unavailable") from exc
        finally:
            call.cancel()

    # --- internals -----------------------------------------------------------------------------------
    async def _write(self, message: engine_core_pb2.ConnectRequest) -> None:
        if self._call is None or not self._connected.is_set():
            raise EngineError("not connected to the scheduler", "unavailable")
        try:
            async with self._write_lock:
                await self._call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise EngineError(f"lost the scheduler: {exc}", "unavailable") from exc

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await asyncio.shield(self.abort(request_id))
        except (EngineError, asyncio.CancelledError):
            pass  # the scheduler is gone, or aborts the request itself when the stream closes

    async def _run_stream(self) -> None:
        backoff_s = 0.2
        while True:
            try:
                info = await self._stub.GetEngineInfo(engine_core_pb2.GetEngineInfoRequest(), timeout=5,
                                                      wait_for_ready=True)
                self.info = codec.engine_info_from_pb(info)
                self._is_worker_alive = True
                self._call = self._stub.Connect()
                if not self._connected.is_set() and gc.get_freeze_count() == 0:
                    # Start-up objects (tokenizer, libraries) live for good: out of the full GC passes,
                    # which would otherwise stall output dispatch for tens of ms now and then.
                    freeze_startup_objects()
                self._connected.set()
                logger.info("connected to scheduler %s (model %s)", self.scheduler_addr, self.info.model_name)
                backoff_s = 0.2
                decoder = codec.OutputsDecoder()  # steady steps leave the ids out: see the proto
                async for response in self._call:
                    self._dispatch(decoder.decode(response.outputs))
                raise EngineError("the scheduler closed the stream", "unavailable")
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, EngineError, ValueError) as exc:  # ValueError: a malformed message
                self._connected.clear()
                if self._call is not None:
                    self._call.cancel()  # a stream we stopped reading: the scheduler drops its requests
                why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self._fail_all(f"lost the scheduler: {why}")
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_RECONNECT_BACKOFF_S)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
        if self.observer is not None:
            self.observer.on_step(outputs)
        queues, held, extras_of = self._queues, self._held, outputs.extras.get
        for request_id, token_ids in zip(outputs.req_ids, outputs.new_token_ids):
            extras = extras_of(request_id)
            pending = held.get(request_id)
            if pending is not None:  # final-only: merged here, handed over when it finishes
                pending.token_ids += token_ids
                if extras is None:
                    continue
                pending.add(extras)
                if not extras.finished:
                    continue
                output = pending.merged(request_id, extras)
            else:
                output = EngineCoreOutput.of(request_id, token_ids, extras)
            queue = queues.get(request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _fail_all(self, message: str) -> None:
        self._held.clear()
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR,
                                              error_message=message, error_code="unavailable"))

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_POLL_INTERVAL_S)
            try:
                self.last_stats, self._is_worker_alive = await self.get_stats()
            except grpc.aio.AioRpcError:
                self._is_worker_alive = False


class HeldOutput:
    """A final-only request's outputs so far, merged as they arrive."""

    __slots__ = ("token_ids", "logprobs", "events", "num_cached_tokens")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.events: list = []
        self.num_cached_tokens = 0

    def add(self, extras: OutputExtras) -> None:
        """A step's extras (its tokens are added to `token_ids` by the caller)."""
        self.logprobs += extras.new_logprobs
        self.events += extras.events
        self.num_cached_tokens = max(self.num_cached_tokens, extras.num_cached_tokens)

    def merged(self, request_id: str, last: OutputExtras) -> EngineCoreOutput:
        """Everything held (`last` included) as one output with `last`'s finish."""
        return EngineCoreOutput(request_id, self.token_ids, self.logprobs, last.finish_reason, last.stop_reason,
                                self.num_cached_tokens, self.events, last.error_message, last.error_code)

