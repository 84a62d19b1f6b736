"""The engine core: the busy loop schedule() -> worker executes -> update_from_output().

With async scheduling (the default) two steps are in flight: step N+1 is sent before step N's
output is read, so the scheduler's work and the gRPC hops overlap the worker's.

Its neighbours have a job each: the `Executor` owns the worker link (handshake, step stream,
reconnection back-off, the step timeout), the `OutputRouter` owns the frontends and which requests
each one owns. The engine core takes requests and aborts in between steps and runs the loop.

A frontend reaches only its own requests (the router scopes ids by frontend): an abort naming
another frontend's request is ignored, and a request id the frontend already has running is refused
without touching the running request. A request that breaks a rule of request_validation.py is
refused at the door, before any step.
"""
from __future__ import annotations

import asyncio
import gc
import logging
from collections import deque
from typing import Callable

from services.common.gc_tuning import freeze_startup_objects
from services.common.kv_events import AllBlocksCleared
from services.common.messages import EngineCoreOutputs, EngineCoreRequest, EngineInfo, SchedulerOutput, SchedulerStats
from services.scheduler.config import SchedulerConfig
from services.scheduler.executor import Executor
from services.scheduler.kv_event_publisher import KVEventPublisher
from services.scheduler.output_router import OutputRouter, error_outputs
from services.scheduler.request import Request
from services.scheduler.request_validation import RequestRejected
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_client import WorkerStepError, WorkerUnavailable

logger = logging.getLogger(__name__)

IDLE_WORKER_CHECK_S = 0.5


class EngineCore:
    def __init__(self, config: SchedulerConfig, executor: Executor, router: OutputRouter | None = None,
                 on_health_change: Callable[[bool], None] | None = None):
        self.config = config
        self.executor = executor
        self.router = router or OutputRouter()
        self.scheduler: Scheduler | None = None
        self.info: EngineInfo | None = None
        self.is_worker_alive = False
        self._on_health_change = on_health_change or (lambda serving: None)
        self.kv_events = KVEventPublisher()
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._wakeup = asyncio.Event()

    # --- requests in, between steps ------------------------------------------------------------------
    def add_request(self, client_id: int, req: EngineCoreRequest) -> None:
        """Takes the client's request for the next step; a refusal goes back to the client alone."""
        if self.is_draining:  # never started: the frontend may send it to another engine
            self.router.send(client_id, error_outputs([req.request_id], "the engine is draining", "draining"))
            return
        if not self.is_worker_alive:
            self.router.send(client_id, error_outputs([req.request_id], "the worker is unavailable", "unavailable"))
            return
        request = Request(req)
        try:  # at the door, so a bad request waits for no step (the scheduler checks again when it adds it)
            self.scheduler.check_request(request)
        except RequestRejected as exc:
            self.router.send(client_id, error_outputs([req.request_id], str(exc), exc.code))
            return
        engine_id = self.router.own(req.request_id, client_id)
        if engine_id is None:
            self.router.send(client_id, error_outputs(
                [req.request_id], f"duplicate request id {req.request_id!r}: this connection already has a "
                "request running with it", "invalid_argument"))
            return
        request.request_id = engine_id  # the frontend's id, unless another frontend's request holds it
        if self.router.tracer is not None:
            self.router.tracer.on_add(request)
        self._pending_adds.append(request)
        self._wakeup.set()

    def abort_requests(self, client_id: int, request_ids: list[str]) -> None:
        """Aborts those of `request_ids` that the client owns; other ids are ignored."""
        self._abort(self.router.release(client_id, request_ids))

    def unregister_client(self, client_id: int) -> None:
        """A frontend went away: its requests are aborted (nobody is left to read them)."""
        self._abort(self.router.unregister_client(client_id))

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats() if self.scheduler is not None else SchedulerStats()

    def num_unfinished_requests(self) -> int:
        pending = len(self._pending_adds)
        return pending + (len(self.scheduler.requests) if self.scheduler is not None else 0)

    @property
    def is_draining(self) -> bool:
        return self.router.is_draining  # one flag: the router tells frontends that connect later too

    def begin_drain(self) -> None:
        """Refuses new requests from now on (error_code "draining") and tells the frontends."""
        self.router.announce_draining()
        self._on_health_change(False)
        self.wake()

    def wake(self) -> None:
        self._wakeup.set()

    # --- the prefix cache, for the engine gRPC API ----------------------------------------------------
    def subscribe_kv_events(self) -> asyncio.Queue:
        """Prefix-cache event batches from now on (kv_event_publisher.py)."""
        queue = self.kv_events.subscribe()
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager.enable_events(True)
        return queue

    def unsubscribe_kv_events(self, queue: asyncio.Queue) -> None:
        self.kv_events.unsubscribe(queue)
        if not self.kv_events.has_subscribers and self.scheduler is not None:
            self.scheduler.kv_cache_manager.enable_events(False)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (nothing done) while a request holds KV blocks."""
        if self.scheduler is None or self._pending_adds:
            return False
        done = self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events(self.scheduler)
        return done

    def _publish_kv_events(self, scheduler: Scheduler) -> None:
        if self.kv_events.has_subscribers:
            self.kv_events.publish(scheduler.kv_cache_manager.take_events())

    def fail_remaining(self, message: str) -> None:
        """Used at the end of a drain: whatever still runs is finished with an error."""
        self._fail_all(message, "unavailable")

    def _abort(self, engine_ids: list[str]) -> None:
        """Requests the router released: one not yet given to the scheduler is dropped at once, the
        others between steps (their ids stay taken in the router until then)."""
        if not engine_ids:
            return
        if self._pending_adds:
            aborted = set(engine_ids)
            dropped = {r.request_id for r in self._pending_adds if r.request_id in aborted}
            if dropped:
                self._pending_adds = [r for r in self._pending_adds if r.request_id not in dropped]
                if self.router.tracer is not None:
                    self.router.tracer.on_aborted(list(dropped))
                self.router.disown(list(dropped))
                engine_ids = [e for e in engine_ids if e not in dropped]
        self._pending_aborts.extend(engine_ids)
        self._wakeup.set()

    # --- the loop ----------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Connects to the worker and runs steps until `stop`; reconnects when the worker is lost."""
        while not stop.is_set():
            try:
                await self._start_worker()
                await self._busy_loop(stop)
            except WorkerUnavailable as exc:
                self._set_worker_alive(False)
                self._fail_all(f"worker unavailable: {exc}", "unavailable")
                logger.warning("%s; retrying", exc)
                await self.executor.wait_before_retry(stop)

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
                await self.executor.submit(scheduler_output)
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
                runner_output = await self.executor.receive()
            except WorkerStepError as exc:
                logger.error("step %d failed on the worker: %s", step.step_id, exc)
                failed = [r.request_id for r in scheduler.abort_requests(list(step.num_scheduled_tokens))]
                scheduler.on_step_failed(step)
                self._publish(error_outputs(failed, f"model execution failed: {exc}", "internal"), scheduler)
                continue
            self._publish(scheduler.update_from_output(step, runner_output), scheduler)
            self._publish_kv_events(scheduler)
            if step.total_num_scheduled_tokens == 0 and not in_flight:
                await asyncio.sleep(0.001)  # nothing fit this step; let frees and aborts arrive

    async def _start_worker(self) -> None:
        spec = await self.executor.start()
        gc.unfreeze()  # an earlier engine's block pool becomes collectable again
        self.scheduler = Scheduler(self.config, spec.num_blocks, spec.block_size, spec.max_model_len,
                                   spec.vocab_size)
        # The block pool (one object per KV block, often 1e5) lives as long as the engine: keep it out of
        # the collector's full passes, each of which would otherwise stall a step for tens of ms.
        freeze_startup_objects()
        if self.kv_events.has_subscribers:  # a new cache: subscribers forget what the old one held
            self.scheduler.kv_cache_manager.enable_events(True)
            self.kv_events.publish([AllBlocksCleared()])
        self.info = EngineInfo(
            model_name=spec.model_name,
            max_model_len=self.scheduler.max_model_len,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            device=spec.device,
            dtype=spec.dtype,
            vocab_size=spec.vocab_size,
            attention_backend=spec.attention_backend,
            max_num_seqs=self.config.max_num_seqs,
        )
        logger.info("worker %s ready: %d KV blocks of %d tokens, max_model_len %d",
                    self.executor.address, spec.num_blocks, spec.block_size, self.scheduler.max_model_len)
        self._set_worker_alive(True)

    async def _wait_for_work(self) -> None:
        """Sleeps until a request or abort arrives, checking meanwhile that the worker is still there,
        so a worker lost while idle turns health NOT_SERVING before the next request finds out."""
        self._wakeup.clear()
        while not self._wakeup.is_set():
            try:
                await asyncio.wait_for(self._wakeup.wait(), IDLE_WORKER_CHECK_S)
            except asyncio.TimeoutError:
                if not self.executor.is_alive():
                    raise WorkerUnavailable("the worker closed its stream while the engine was idle")

    def _apply_pending(self, scheduler: Scheduler) -> None:
        if self._pending_aborts:
            aborts, self._pending_aborts = self._pending_aborts, []
            if self.router.tracer is not None:
                self.router.tracer.on_aborted(aborts)
            scheduler.abort_requests(aborts)
            self.router.disown(aborts)  # found or not (finished meanwhile): the ids are free again
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            try:
                scheduler.add_request(request)
            except RequestRejected as exc:
                self._publish(error_outputs([request.request_id], str(exc), exc.code), scheduler)

    def _fail_all(self, message: str, code: str) -> None:
        requests = self.scheduler.fail_all() if self.scheduler is not None else []
        requests += self._pending_adds
        self._pending_adds = []
        self.router.disown(self._pending_aborts)
        self._pending_aborts = []
        self._publish(error_outputs([r.request_id for r in requests], message, code), None)

    def _publish(self, step: EngineCoreOutputs, scheduler: Scheduler | None) -> None:
        if step.req_ids:  # the stats are read only for a step that has outputs
            self.router.publish(step, scheduler.get_stats() if scheduler is not None else None)

    def _set_worker_alive(self, alive: bool) -> None:
        if alive != self.is_worker_alive:
            self.is_worker_alive = alive
            self._on_health_change(alive and not self.is_draining)
