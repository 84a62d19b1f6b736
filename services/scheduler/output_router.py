"""The frontends connected to the engine core, which requests each one owns, and each step's
outputs routed to their owners: one `EngineCoreOutputs` per frontend per step."""
from __future__ import annotations

import asyncio
import itertools
import time

from services.common.messages import EngineCoreOutputs, FinishReason, OutputExtras, SchedulerStats
from services.scheduler.tracing import SchedulerTracer


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
        self._clients: dict[int, asyncio.Queue[EngineCoreOutputs | None]] = {}
        self._owners: dict[str, int] = {}  # request id -> client id

    def register_client(self) -> tuple[int, asyncio.Queue[EngineCoreOutputs | None]]:
        client_id = next(self._client_ids)
        queue = self._clients[client_id] = asyncio.Queue()
        return client_id, queue

    def unregister_client(self, client_id: int) -> list[str]:
        """Forgets the frontend; returns the ids of the requests it owned (nobody is left to read them)."""
        self._clients.pop(client_id, None)
        owned = [request_id for request_id, owner in self._owners.items() if owner == client_id]
        self.disown(owned)
        return owned

    def own(self, request_id: str, client_id: int) -> None:
        self._owners[request_id] = client_id

    def owner(self, request_id: str) -> int | None:
        return self._owners.get(request_id)

    def disown(self, request_ids: list[str]) -> None:
        """The requests publish nothing more (aborted, or refused before they ran)."""
        for request_id in request_ids:
            self._owners.pop(request_id, None)

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
        if len(client_ids) == 1:  # the usual case: one frontend owns every request
            (client_id,) = client_ids
            if client_id is not None:
                by_client[client_id] = step
        else:
            extras_of = step.extras.get
            for req_id, token_ids in zip(step.req_ids, step.new_token_ids):
                client_id = owners.get(req_id)
                if client_id is not None:
                    routed = by_client.get(client_id)
                    if routed is None:
                        routed = by_client[client_id] = EngineCoreOutputs()
                    routed.append(req_id, token_ids, extras_of(req_id))
        for req_id, extras in step.extras.items():
            if extras.finished:
                owners.pop(req_id, None)
        now = time.time()
        for client_id, routed in by_client.items():
            queue = self._clients.get(client_id)
            if queue is not None:
                routed.scheduler_stats, routed.timestamp = stats, now
                queue.put_nowait(routed)
