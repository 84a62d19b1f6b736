"""The frontends connected to the engine core, which requests each one owns, and each step's
outputs routed to their owners: one `EngineCoreOutputs` per frontend per step.

Request ids are scoped by frontend: a frontend can reach only its own requests (abort them, or be
refused a duplicate id), and its ids never collide with another frontend's. The engine keys a
request by its frontend's id unless another frontend's request holds that id; then the engine gives
it an id of its own (an alias, only ever seen inside the engine) and the router names it by the
frontend's id again in what it sends back. Aliases are rare (two frontends' ids colliding), and a
step pays for them only while one exists.
"""
from __future__ import annotations

import asyncio
import itertools
import time

from services.common.messages import EngineCoreOutputs, FinishReason, OutputExtras, SchedulerStats
from services.scheduler.tracing import SchedulerTracer


class DrainNotice:
    """Put on every frontend's queue when the engine begins to drain: its stream says so once."""


DRAIN_NOTICE = DrainNotice()


def error_outputs(request_ids: list[str], message: str, code: str) -> EngineCoreOutputs:
    """The requests finished with an error, as one step's outputs."""
    outputs = EngineCoreOutputs()
    for request_id in request_ids:
        outputs.append(request_id, [], OutputExtras(finish_reason=FinishReason.ERROR, error_message=message,
                                                    error_code=code))
    return outputs


class OutputRouter:
    def __init__(self, tracer: SchedulerTracer | None = None):
        # Observability hook: per-request spans (services/scheduler/tracing.py); None when tracing is off.
        self.tracer = tracer
        self._client_ids = itertools.count(1)
        # Per frontend: its step outputs; None tells its stream handler that the frontend went away.
        self._clients: dict[int, asyncio.Queue[EngineCoreOutputs | DrainNotice | None]] = {}
        self.is_draining = False
        # Engine request id -> client id; None once aborted: its outputs go nowhere, and the id stays
        # taken until the scheduler has dropped the request (`disown`), so steps in flight cannot
        # hand its tokens to a new request of the same id.
        self._owners: dict[str, int | None] = {}
        # Only for requests whose frontend's id another frontend's request held: both ways.
        self._aliases: dict[tuple[int, str], str] = {}  # (client id, its request id) -> engine id
        self._frontend_ids: dict[str, str] = {}  # engine id -> the frontend's request id

    def register_client(self) -> tuple[int, asyncio.Queue[EngineCoreOutputs | DrainNotice | None]]:
        client_id = next(self._client_ids)
        queue = self._clients[client_id] = asyncio.Queue()
        if self.is_draining:
            queue.put_nowait(DRAIN_NOTICE)
        return client_id, queue

    def announce_draining(self) -> None:
        """Tells every frontend, now and any that connects later, that the engine drains."""
        if not self.is_draining:
            self.is_draining = True
            for queue in self._clients.values():
                queue.put_nowait(DRAIN_NOTICE)

    def unregister_client(self, client_id: int) -> list[str]:
        """Forgets the frontend; returns the engine ids of the requests it owned (nobody is left to
        read them: the caller aborts them), released as `release` does."""
        self._clients.pop(client_id, None)
        owned = [request_id for request_id, owner in self._owners.items() if owner == client_id]
        self._release(owned)
        return owned

    def own(self, request_id: str, client_id: int) -> str | None:
        """Registers the client's new request; returns the engine's id for it (`request_id` itself
        unless another request holds that id), or None if the client already has a request
        `request_id` (a duplicate, which the caller refuses)."""
        if self.engine_id(client_id, request_id) is not None:
            return None
        engine_id = request_id
        if engine_id in self._owners:
            n = 0
            while engine_id in self._owners:  # `request_id#client.n`: free, whatever ids frontends choose
                n += 1
                engine_id = f"{request_id}#{client_id}.{n}"
            self._aliases[(client_id, request_id)] = engine_id
            self._frontend_ids[engine_id] = request_id
        self._owners[engine_id] = client_id
        return engine_id

    def engine_id(self, client_id: int, request_id: str) -> str | None:
        """The engine's id of the client's live request `request_id`; None if the client has none."""
        if self._owners.get(request_id) == client_id and request_id not in self._frontend_ids:
            return request_id
        return self._aliases.get((client_id, request_id))

    def owner(self, request_id: str) -> int | None:
        """The client of the request with this engine id (None: none, or aborted)."""
        return self._owners.get(request_id)

    def release(self, client_id: int, request_ids: list[str]) -> list[str]:
        """The client aborts these of its requests: returns their engine ids, whose outputs go nowhere
        from now on; the client's ids are free again at once. Ids it does not own are ignored."""
        engine_ids = [self.engine_id(client_id, request_id) for request_id in request_ids]
        engine_ids = [engine_id for engine_id in engine_ids if engine_id is not None]
        self._release(engine_ids)
        return engine_ids

    def disown(self, request_ids: list[str]) -> None:
        """Forgets the requests with these engine ids (the scheduler dropped them, or never took them)."""
        for request_id in request_ids:
            self._forget(request_id)

    def _release(self, engine_ids: list[str]) -> None:
        for engine_id in engine_ids:
            self._drop_alias(engine_id)
            self._owners[engine_id] = None  # still taken, until disowned

    def _forget(self, engine_id: str) -> None:
        if self._frontend_ids:
            self._drop_alias(engine_id)
        self._owners.pop(engine_id, None)

    def _drop_alias(self, engine_id: str) -> None:
        frontend_id = self._frontend_ids.pop(engine_id, None)
        if frontend_id is not None:
            self._aliases.pop((self._owners.get(engine_id), frontend_id), None)

    def send(self, client_id: int, outputs: EngineCoreOutputs) -> None:
        """Outputs for one frontend's requests that no step produced (a refusal at the door)."""
        queue = self._clients.get(client_id)
        if queue is not None:
            outputs.timestamp = time.time()
            queue.put_nowait(outputs)

    def publish(self, step: EngineCoreOutputs, stats: SchedulerStats | None) -> None:
        """Routes a step's outputs to the frontends that own the requests, one message each with
        the engine's stats; a finished request is forgotten once routed."""
        if not step.req_ids:
            return
        if self.tracer is not None:
            self.tracer.on_outputs(step)
        owners = self._owners
        by_client: dict[int, EngineCoreOutputs] = {}
        client_ids = set(map(owners.get, step.req_ids))
        frontend_ids = self._frontend_ids
        if len(client_ids) == 1 and not frontend_ids:  # the usual case: one frontend owns every request
            (client_id,) = client_ids
            if client_id is not None:
                by_client[client_id] = step
        else:
            extras_of = step.extras.get
            frontend_id = frontend_ids.get
            for req_id, token_ids in zip(step.req_ids, step.new_token_ids):
                client_id = owners.get(req_id)
                if client_id is not None:
                    routed = by_client.get(client_id)
                    if routed is None:
                        routed = by_client[client_id] = EngineCoreOutputs()
                    routed.append(frontend_id(req_id, req_id), token_ids, extras_of(req_id))
        for req_id, extras in step.extras.items():
            if extras.finished and owners.get(req_id) is not None:  # an aborted one waits for `disown`
                self._forget(req_id)
        now = time.time()
        for client_id, routed in by_client.items():
            queue = self._clients.get(client_id)
            if queue is not None:
                routed.scheduler_stats, routed.timestamp = stats, now
                queue.put_nowait(routed)
