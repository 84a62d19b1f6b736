"""The worker side of the engine core: the handshake, the step stream and reconnection, over the
worker ranks that serve one engine.

Each rank is a `WorkerClient` (one today). A step is sent to every rank, in order; each rank answers
every step, and the output is the first rank's (the sampling rank). The KV cache the scheduler plans
with is the smallest any rank reported.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol

from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput

MIN_RECONNECT_BACKOFF_S = 0.2
MAX_RECONNECT_BACKOFF_S = 5.0


class WorkerLink(Protocol):
    """One worker rank as the executor uses it (`WorkerClient`, or a test's in-process worker)."""

    address: str

    async def connect(self) -> KVCacheSpec: ...

    async def initialize(self, num_blocks: int) -> None: ...

    async def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    async def receive(self) -> ModelRunnerOutput: ...

    def is_stream_open(self) -> bool: ...

    async def close(self) -> None: ...


class Executor:
    def __init__(self, workers: list[WorkerLink]):
        if not workers:
            raise ValueError("an executor needs at least one worker")
        self.workers = workers
        self._backoff_s = MIN_RECONNECT_BACKOFF_S

    @property
    def address(self) -> str:
        return ",".join(w.address for w in self.workers)

    async def start(self) -> KVCacheSpec:
        """Connects every rank and allocates the KV cache all of them can hold; raises
        WorkerUnavailable (services/scheduler/worker_client.py) when a rank cannot be reached."""
        specs = [await w.connect() for w in self.workers]
        spec = dataclasses.replace(specs[0], num_blocks=min(s.num_blocks for s in specs))
        for worker in self.workers:
            await worker.initialize(spec.num_blocks)
        self._backoff_s = MIN_RECONNECT_BACKOFF_S
        return spec

    async def submit(self, scheduler_output: SchedulerOutput) -> None:
        for worker in self.workers:
            await worker.submit(scheduler_output)

    async def receive(self) -> ModelRunnerOutput:
        """The output of the oldest step sent and not yet received: every rank's answer is read (so
        a failed rank is noticed), the sampling rank's is returned."""
        outputs = [await w.receive() for w in self.workers]
        return outputs[0]

    def is_alive(self) -> bool:
        return all(w.is_stream_open() for w in self.workers)

    async def wait_before_retry(self, stop: asyncio.Event) -> float:
        """After a lost worker: waits the back-off (shorter if `stop` is set), doubling it up to
        MAX_RECONNECT_BACKOFF_S for the next time; returns how long it waited at most."""
        backoff_s = self._backoff_s
        self._backoff_s = min(backoff_s * 2, MAX_RECONNECT_BACKOFF_S)
        try:
            await asyncio.wait_for(stop.wait(), backoff_s)
        except asyncio.TimeoutError:
            pass
        return backoff_s

    async def close(self) -> None:
        for worker in self.workers:
            await worker.close()
