"""The engine core: the busy loop schedule() -> worker executes -> update_from_output().

With async scheduling (the default) two steps are in flight: step N+1 is sent before step N's
output is read, so the scheduler's work and the gRPC hops overlap the worker's.

It owns the worker connection (handshake, reconnect with back-off) and routes each step's outputs
to the frontend connections that own the requests: one EngineCoreOutputs per frontend per step.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import time
from collections import deque
from typing import Callable

from services.common.gc_tuning import freeze_startup_objects
from services.common.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    OutputExtras,
    SchedulerOutput,
    SchedulerStats,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestRejected, Scheduler
from services.scheduler.tracing import SchedulerTracer
from services.scheduler.worker_client import WorkerClient, WorkerStepError, WorkerUnavailable

logger = logging.getLogger(__name__)

MAX_RECONNECT_BACKOFF_S = 5.0
IDLE_WORKER_CHECK_S = 0.5


def error_outputs(request_ids: list[str], message: str, code: str) -> EngineCoreOutputs:
    """The requests finished with an error, as one step's outputs."""
    outputs = EngineCoreOutputs()
    for request_id in request_ids:
        outputs.append(request_id, [], OutputExtras(finish_reason=FinishReason.ERROR, error_message=message,
                                                    error_code=code))
    return outputs


class EngineCore:
    def __init__(self, config: SchedulerConfig, worker: WorkerClient,
                 on_health_change: Callable[[bool], None] | None = None, tracer: SchedulerTracer | None = None):
        self.config = config
        # Observability hook: per-request spans (services/scheduler/tracing.py); None when tracing is off.
        self.tracer = tracer
        self.worker = worker
        self.scheduler: Scheduler | None = None
        self.info: EngineInfo | None = None
        self.is_worker_alive = False
        self.is_draining = False
        self._on_health_change = on_health_change or (lambda serving: None)
        self._client_ids = itertools.count(1)
        # Per frontend: its step outputs; None tells its stream handler that the frontend went away.
        self._clients: dict[int, asyncio.Queue[EngineCoreOutputs | None]] = {}
        self._req_client: dict[str, int] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._wakeup = asyncio.Event()

    # --- frontend connections ----------------------------------------------------------------------
    def register_client(self) -> tuple[int, asyncio.Queue[EngineCoreOutputs | None]]:
        client_id = next(self._client_ids)
        self._clients[client_id] = asyncio.Queue()
        return client_id, self._clients[client_id]

    def unregister_client(self, client_id: int) -> None:
        """A frontend went away: its requests are aborted (nobody is left to read them)."""
        self._clients.pop(client_id, None)
        self.abort_requests([rid for rid, cid in self._req_client.items() if cid == client_id])

    def add_request(self, client_id: int, req: EngineCoreRequest) -> None:
        if not self.is_worker_alive or self.is_draining:
            why = "the engine is draining" if self.is_draining else "the worker is unavailable"
            self._send(client_id, error_outputs([req.request_id], why, "unavailable"))
            return
        self._req_client[req.request_id] = client_id
        request = Request(req)
        if self.tracer is not None:
            self.tracer.on_add(request)
        self._pending_adds.append(request)
        self._wakeup.set()

    def abort_requests(self, request_ids: list[str]) -> None:
        self._pending_aborts.extend(request_ids)
        self._wakeup.set()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats() if self.scheduler is not None else SchedulerStats()

    def num_unfinished_requests(self) -> int:
        pending = len(self._pending_adds)
        return pending + (len(self.scheduler.requests) if self.scheduler is not None else 0)

    # --- the loop ----------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Connects to the worker and runs steps until `stop`; reconnects when the worker is lost."""
        backoff_s = 0.2
        while not stop.is_set():
            try:
                await self._start_worker()
                backoff_s = 0.2
                await self._busy_loop(stop)
            except WorkerUnavailable as exc:
                self._set_worker_alive(False)
                self._fail_all(f"worker unavailable: {exc}", "unavailable")
                logger.warning("%s; retrying in %.1f s", exc, backoff_s)
                try:
                    await asyncio.wait_for(stop.wait(), backoff_s)
                except asyncio.TimeoutError:
                    pass
                backoff_s = min(backoff_s * 2, MAX_RECONNECT_BACKOFF_S)

    def wake(self) -> None:
        self._wakeup.set()

    async def _start_worker(self) -> None:
        spec = await self.worker.connect()
        await self.worker.initialize(spec.num_blocks)
        gc.unfreeze()  # an earlier engine's block pool becomes collectable again
        self.scheduler = Scheduler(self.config, spec.num_blocks, spec.block_size, spec.max_model_len)
        # The block pool (one object per KV block, often 1e5) lives as long as the engine: keep it out of
        # the collector's full passes, each of which would otherwise stall a step for tens of ms.
        freeze_startup_objects()
        self.info = EngineInfo(
            model_name=spec.model_name,
            max_model_len=self.scheduler.max_model_len,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            device=spec.device,
            dtype=spec.dtype,
            vocab_size=spec.vocab_size,
            attention_backend=spec.attention_backend,
        )
        logger.info("worker %s ready: %d KV blocks of %d tokens, max_model_len %d",
                    self.worker.address, spec.num_blocks, spec.block_size, self.scheduler.max_model_len)
        self._set_worker_alive(True)

    async def _busy_loop(self, stop: asyncio.Event) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        # Steps sent to the worker whose outputs have not come back, oldest first. With async
        # scheduling the next step is sent before the last one's output is read, so the worker
        # starts it at once while this loop updates requests and publishes outputs.
        in_flight: deque[SchedulerOutput] = deque()
        max_in_flight = 2 if self.config.async_scheduling else 1
        while True:
            self._apply_pending(scheduler)
            if scheduler.has_unfinished_requests() or scheduler.finished_req_ids:
                scheduler_output = scheduler.schedule()
                await self.worker.submit(scheduler_output)
                in_flight.append(scheduler_output)
                if len(in_flight) < max_in_flight and scheduler_output.total_num_scheduled_tokens:
                    continue
            elif not in_flight:
                if stop.is_set():
                    return
                await self._wait_for_work()
                continue
            step = in_flight.popleft()
            try:
                runner_output = await self.worker.receive()
            except WorkerStepError as exc:
                logger.error("step %d failed on the worker: %s", step.step_id, exc)
                failed = scheduler.abort_requests(list(step.num_scheduled_tokens))
                self._publish(error_outputs([r.request_id for r in failed], f"model execution failed: {exc}",
                                            "internal"), scheduler)
                continue
            self._publish(scheduler.update_from_output(step, runner_output), scheduler)
            if step.total_num_scheduled_tokens == 0 and not in_flight:
                await asyncio.sleep(0.001)  # nothing fit this step; let frees and aborts arrive

    async def _wait_for_work(self) -> None:
        """Sleeps until a request or abort arrives, checking meanwhile that the worker is still there,
        so a worker lost while idle turns health NOT_SERVING before the next request finds out."""
        self._wakeup.clear()
        while not self._wakeup.is_set():
            try:
                await asyncio.wait_for(self._wakeup.wait(), IDLE_WORKER_CHECK_S)
            except asyncio.TimeoutError:
                if not self.worker.is_stream_open():
                    raise WorkerUnavailable("the worker closed its stream while the engine was idle")

    def _apply_pending(self, scheduler: Scheduler) -> None:
        if self._pending_aborts:
            aborts, self._pending_aborts = self._pending_aborts, []
            if self.tracer is not None:
                self.tracer.on_aborted(aborts)
            for request in scheduler.abort_requests(aborts):
                self._req_client.pop(request.request_id, None)
            aborted = set(aborts)
            for request in [r for r in self._pending_adds if r.request_id in aborted]:
                self._pending_adds.remove(request)
                self._req_client.pop(request.request_id, None)
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            try:
                scheduler.add_request(request)
            except RequestRejected as exc:
                self._publish(error_outputs([request.request_id], str(exc), exc.code), scheduler)

    def _publish(self, step: EngineCoreOutputs, scheduler: Scheduler | None) -> None:
        """Routes a step's outputs to the frontends that own the requests, one message each."""
        if not step.req_ids:
            return
        if self.tracer is not None:
            self.tracer.on_outputs(step)
        req_client = self._req_client
        by_client: dict[int, EngineCoreOutputs] = {}
        client_ids = set(map(req_client.get, step.req_ids))
        if len(client_ids) == 1:  # the usual case: one frontend owns every request
            (client_id,) = client_ids
            if client_id is not None:
                by_client[client_id] = step
        else:
            extras_of = step.extras.get
            for req_id, token_ids in zip(step.req_ids, step.new_token_ids):
                client_id = req_client.get(req_id)
                if client_id is not None:
                    self._client_outputs(by_client, client_id).append(req_id, token_ids, extras_of(req_id))
        for req_id, extras in step.extras.items():
            if extras.finished:  # routed above by its owner; nothing more comes for it
                req_client.pop(req_id, None)
        stats = scheduler.get_stats() if scheduler is not None else None
        now = time.time()
        for client_id, routed in by_client.items():
            queue = self._clients.get(client_id)
            if queue is not None:
                routed.scheduler_stats, routed.timestamp = stats, now
                queue.put_nowait(routed)

    @staticmethod
    def _client_outputs(by_client: dict[int, EngineCoreOutputs], client_id: int) -> EngineCoreOutputs:
        routed = by_client.get(client_id)
        if routed is None:
            routed = by_client[client_id] = EngineCoreOutputs()
        return routed

    def _send(self, client_id: int, outputs: EngineCoreOutputs) -> None:
        queue = self._clients.get(client_id)
        if queue is not None:
            outputs.timestamp = time.time()
            queue.put_nowait(outputs)

    def _fail_all(self, message: str, code: str) -> None:
        requests = self.scheduler.fail_all() if self.scheduler is not None else []
        requests += self._pending_adds
        self._pending_adds = []
        self._pending_aborts = []
        self._publish(error_outputs([r.request_id for r in requests], message, code), None)

    def fail_remaining(self, message: str) -> None:
        """Used at the end of a drain: whatever still runs is finished with an error."""
        self._fail_all(message, "unavailable")

    def _set_worker_alive(self, alive: bool) -> None:
        if alive != self.is_worker_alive:
            self.is_worker_alive = alive
            self._on_health_change(alive and not self.is_draining)
