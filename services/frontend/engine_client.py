"""The frontend's connection to the engine core: a long-lived bidirectional stream to the scheduler.

Requests and aborts go out on the stream; one EngineCoreOutputs per engine step comes back and is
dispatched to per-request queues. A request that only wants its final output (non-streaming, no stop
strings) is not woken every step: its outputs are held here and handed over merged when it finishes,
so a step costs such a request one list extend instead of a task wake-up. A streamed request with a
stream interval above one is held the same way between handovers (`HeldOutput`). A step's plain
outputs (new tokens only) arrive in columns and become objects only for requests that are woken.

Handover: when the engine says it drains (or its stream ends), the client is unready at once and
opens a new connection (`EngineConnection`), while the draining engine finishes the requests it
runs on the old one. A request that arrives meanwhile waits up to `max_wait_s` for a ready engine,
and one the draining engine refused at the door (error_code "draining": never started) is sent
again on the new connection, so a rollout costs the requests that had not started no error. When
the scheduler goes away, the requests it was running fail with an "unavailable" error.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from typing import Any, AsyncIterator, Callable, Sequence

import grpc

from services.common import codec
from services.common.gc_tuning import freeze_startup_objects
from services.common.kv_events import KVEventBatch
from services.common.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    SchedulerStats,
)
from services.common.pb import engine_core_pb2
from services.common.service_auth import NO_SERVICE_AUTH, ServiceAuthConfig
from services.frontend.engine_connection import MAX_RECONNECT_BACKOFF_S, EngineConnection
from services.frontend.engine_protocol import StepObserver
from services.frontend.errors import EngineError
from services.frontend.held_output import UNTIL_FINISHED, HeldOutput

logger = logging.getLogger(__name__)

STATS_POLL_INTERVAL_S = 1.0
MIN_RECONNECT_BACKOFF_S = 0.2
DEFAULT_MAX_WAIT_S = 10.0
# A request refused by draining engines this many times in a row fails (unavailable).
MAX_SEND_ATTEMPTS = 3


class EngineClient:
    def __init__(self, scheduler_addr: str, interceptors: Sequence[Any] = (),
                 auth: ServiceAuthConfig = NO_SERVICE_AUTH, max_wait_s: float = DEFAULT_MAX_WAIT_S):
        self.scheduler_addr = scheduler_addr
        self.max_wait_s = max_wait_s
        self.info: EngineInfo | None = None
        self.last_stats = SchedulerStats()
        # Observability hook: sees every step's outputs (services/frontend/observability.py); set by the server.
        self.observer: StepObserver | None = None
        # Called whenever `is_ready` turns, so gRPC health follows at once (HTTP /health reads it live).
        self.on_readiness_change: Callable[[], None] | None = None
        self._is_worker_alive = False
        # `interceptors`: the tracing interceptors when tracing is on (services/common/telemetry.py);
        # `auth`: this frontend's certificate and/or the scheduler's token (services/common/service_auth.py).
        self._interceptors, self._auth = interceptors, auth
        self._latest = EngineConnection(scheduler_addr, auth, interceptors)  # the newest: stats, control calls
        self._active: EngineConnection | None = None  # where new requests go; None while unready
        self._connections: set[EngineConnection] = {self._latest}
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        self._connection_of: dict[str, EngineConnection] = {}
        # Outputs held for final-only requests until they finish.
        self._held: dict[str, HeldOutput] = {}
        self._ready = asyncio.Event()  # set while `is_ready`
        self._replace = asyncio.Event()  # the active connection drained or ended: open another
        self._tasks: list[asyncio.Task] = []
        self._readers: set[asyncio.Task] = set()

    @property
    def is_ready(self) -> bool:
        return self._active is not None and self._is_worker_alive and self.info is not None

    async def wait_ready(self) -> bool:
        """Whether an engine is ready, waiting up to `max_wait_s` for one (a handover in progress)."""
        if not self.is_ready and self.max_wait_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ready.wait(), self.max_wait_s)
        return self.is_ready

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._maintain_connection()), asyncio.create_task(self._poll_stats())]

    async def close(self) -> None:
        for task in [*self._tasks, *self._readers]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._readers, return_exceptions=True)
        for connection in list(self._connections):
            await connection.close()

    async def generate(self, request: EngineCoreRequest, final_only: bool = False, stream_interval: int = 1
                       ) -> AsyncIterator[EngineCoreOutput]:
        """Yields the request's outputs until one finishes it; leaving early aborts the request.

        With `final_only` the outputs come merged into one, when the request finishes; otherwise
        merged every `stream_interval` tokens, the first token and the finish at once.
        """
        request_id = request.request_id
        if request_id in self._queues:
            raise EngineError(f"duplicate request id {request_id!r}", "invalid_argument")
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        message = engine_core_pb2.ConnectRequest(add_request=codec.engine_core_request_to_pb(request))
        finished = False
        try:
            for _ in range(MAX_SEND_ATTEMPTS):
                if not await self.wait_ready():
                    raise EngineError("the engine is not ready", "unavailable")
                connection = self._send_on(self._active, request_id, UNTIL_FINISHED if final_only else stream_interval)
                await connection.write(message)
                while True:
                    output = await queue.get()
                    if output.finish_reason == FinishReason.ERROR:
                        if output.error_code == "draining":  # refused before it started
                            self._on_draining(connection)  # the refusal may come before the notice
                            break  # send it to the next engine
                        finished = True
                        raise EngineError(output.error_message or "engine error", output.error_code or "internal")
                    finished = output.finished
                    yield output
                    if finished:
                        return
            finished = True  # every attempt refused at the door: nothing runs
            raise EngineError("the engine is draining", "unavailable")
        finally:
            self._queues.pop(request_id, None)
            self._held.pop(request_id, None)
            connection = self._connection_of.pop(request_id, None)
            if connection is not None:
                connection.request_ids.discard(request_id)
                if not finished:
                    await self._abort_quietly(connection, request_id)

    async def abort(self, request_id: str) -> None:
        connection = self._connection_of.get(request_id)
        if connection is not None:
            await _send_abort(connection, request_id)

    async def get_stats(self) -> tuple[SchedulerStats, bool]:
        stats, is_worker_alive, _ = await self._get_stats(self._active or self._latest)
        return stats, is_worker_alive

    async def reset_prefix_cache(self) -> bool:
        stub = (self._active or self._latest).stub
        try:
            response = await stub.ResetPrefixCache(engine_core_pb2.ResetPrefixCacheRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise EngineError(f"the scheduler did not reset its prefix cache: {exc.details()}", "unavailable") from exc
        return response.done

    async def subscribe_kv_events(self) -> AsyncIterator[KVEventBatch]:
        call = (self._active or self._latest).stub.SubscribeKvEvents(engine_core_pb2.SubscribeKvEventsRequest())
        try:
            async for batch in call:
                yield codec.kv_event_batch_from_pb(batch)
        except grpc.aio.AioRpcError as exc:
            raise EngineError(f"the scheduler's KV event stream ended: {exc.details()}", "unavailable") from exc
        finally:
            call.cancel()

    # --- internals -----------------------------------------------------------------------------------
    def _send_on(self, connection: EngineConnection, request_id: str, hold_interval: int) -> EngineConnection:
        """Sends `request_id`'s outputs from `connection` to its queue, held as `hold_interval` says
        (`HeldOutput`; 1: every step's at once)."""
        previous = self._connection_of.get(request_id)
        if previous is not None:
            previous.request_ids.discard(request_id)
        self._connection_of[request_id] = connection
        connection.request_ids.add(request_id)
        if hold_interval != 1:
            self._held[request_id] = HeldOutput(hold_interval)
        return connection

    async def _abort_quietly(self, connection: EngineConnection, request_id: str) -> None:
        try:
            await asyncio.shield(_send_abort(connection, request_id))
        except (EngineError, asyncio.CancelledError):
            pass  # the scheduler is gone, or aborts the request itself when the stream closes

    def _set_active(self, connection: EngineConnection | None) -> None:
        was_ready = self._ready.is_set()
        self._active = connection
        if self.is_ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self._ready.is_set() != was_ready and self.on_readiness_change is not None:
            self.on_readiness_change()

    def _set_worker_alive(self, alive: bool) -> None:
        self._is_worker_alive = alive
        self._set_active(self._active)

    def _retire(self, connection: EngineConnection, why: str) -> None:
        """No new requests go to `connection` from now on; the client opens another."""
        if self._active is connection:
            self._set_active(None)
            self._replace.set()
            logger.info("scheduler %s: %s; opening a new connection", self.scheduler_addr, why)

    def _on_draining(self, connection: EngineConnection) -> None:
        connection.is_draining = True
        self._retire(connection, "the engine is draining")

    def _new_connection(self) -> EngineConnection:
        connection = EngineConnection(self.scheduler_addr, self._auth, self._interceptors)
        self._connections.add(connection)
        self._latest = connection
        return connection

    async def _discard(self, connection: EngineConnection) -> None:
        self._connections.discard(connection)
        await connection.close()

    async def _maintain_connection(self) -> None:
        """Keeps an active connection to a ready engine, opening a new one whenever it is retired."""
        backoff_s = MIN_RECONNECT_BACKOFF_S
        connection = self._latest
        while True:
            try:
                info = await connection.open()
            except grpc.aio.AioRpcError as exc:
                logger.debug("scheduler %s not ready: %s", self.scheduler_addr, exc.details())
                # A draining engine, perhaps: the next channel (a new TCP connection) may reach another.
                # The new one is made first: stats and control calls always have an open channel.
                failed, connection = connection, self._new_connection()
                await self._discard(failed)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_RECONNECT_BACKOFF_S)
                continue
            self.info = info
            self._is_worker_alive = True
            self._replace.clear()
            self._set_active(connection)
            if gc.get_freeze_count() == 0:
                # Start-up objects (tokenizer, libraries) live for good: out of the full GC passes,
                # which would otherwise stall output dispatch for tens of ms now and then.
                freeze_startup_objects()
            logger.info("connected to scheduler %s (model %s)", self.scheduler_addr, info.model_name)
            reader = asyncio.create_task(self._read(connection))
            self._readers.add(reader)
            reader.add_done_callback(self._readers.discard)
            await self._replace.wait()
            was_lost = not connection.is_draining
            if self._latest is connection:
                self._new_connection()
            connection = self._latest
            if was_lost:  # lost, not drained: back off before trying again
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_RECONNECT_BACKOFF_S)
            else:
                backoff_s = MIN_RECONNECT_BACKOFF_S

    async def _read(self, connection: EngineConnection) -> None:
        """Dispatches the connection's outputs until its stream ends, then fails what still ran on it."""
        decoder = codec.OutputsDecoder()  # steady steps leave the ids out: see the proto
        try:
            async for response in connection.responses():
                if response.draining:
                    self._on_draining(connection)
                    continue
                self._dispatch(decoder.decode(response.outputs))
            why = "the scheduler closed the stream"
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            why = exc.details()
        except ValueError as exc:  # a malformed message
            why = str(exc)
        self._retire(connection, f"lost ({why})")
        self._fail(connection, f"lost the scheduler: {why}")
        if self._latest is connection:  # stats and control calls keep an open channel
            self._new_connection()
        await self._discard(connection)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
        if self.observer is not None:
            self.observer.on_step(outputs)
        queues, held, extras_of = self._queues, self._held, outputs.extras.get
        for request_id, token_ids in zip(outputs.req_ids, outputs.new_token_ids):
            extras = extras_of(request_id)
            pending = held.get(request_id)
            if pending is not None:  # merged here, handed over when due
                pending.add(token_ids, extras)
                if not pending.is_due(extras):
                    continue
                output = pending.take(request_id, extras)
            else:
                output = EngineCoreOutput.of(request_id, token_ids, extras)
            queue = queues.get(request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _fail(self, connection: EngineConnection, message: str) -> None:
        """Ends every request still running on `connection` with an "unavailable" error."""
        for request_id in list(connection.request_ids):
            self._held.pop(request_id, None)
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR,
                                                  error_message=message, error_code="unavailable"))
        connection.request_ids.clear()

    async def _get_stats(self, connection: EngineConnection) -> tuple[SchedulerStats, bool, bool]:
        response = await connection.stub.GetStats(engine_core_pb2.GetStatsRequest(), timeout=5)
        return (codec.scheduler_stats_from_pb(response.scheduler_stats), response.is_worker_alive,
                response.is_draining)

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_POLL_INTERVAL_S)
            connection = self._active or self._latest
            try:
                self.last_stats, is_worker_alive, is_draining = await self._get_stats(connection)
            except grpc.aio.AioRpcError:
                is_worker_alive, is_draining = False, False
            self._set_worker_alive(is_worker_alive)
            if is_draining and connection is self._active:  # the stream's notice, should a message be late
                self._on_draining(connection)


async def _send_abort(connection: EngineConnection, request_id: str) -> None:
    await connection.write(engine_core_pb2.ConnectRequest(
        abort_requests=engine_core_pb2.AbortRequests(request_ids=[request_id])))
