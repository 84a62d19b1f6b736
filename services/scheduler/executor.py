"""The worker side of the engine core: the handshake, the step stream and reconnection, over the
worker ranks that serve one engine.

Each rank is a `WorkerClient` (one today). A step is sent to every rank, in order; each rank answers
every step, and the output is the first rank's (the sampling rank). The KV cache the scheduler plans
with is the smallest any rank reported.

A rank that neither takes a step nor answers it within `step_timeout_s` (a hung worker: stopped,
deadlocked, its device wedged) is lost exactly as a dead one is: the executor cancels every rank's
stream and raises WorkerUnavailable, and the engine reconnects with back-off. The timeout must
exceed the slowest legitimate step; 0 turns it off.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from typing import Protocol

from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from services.scheduler.worker_client import WorkerUnavailable

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
    def __init__(self, workers: list[WorkerLink], step_timeout_s: float = 0.0):
        if not workers:
            raise ValueError("an executor needs at least one worker")
        if step_timeout_s < 0:
            raise ValueError("step_timeout_s must be >= 0 (0 turns the timeout off)")
        self.workers = workers
        self.step_timeout_s = step_timeout_s
        self._backoff_s = MIN_RECONNECT_BACKOFF_S
        self._in_flight_step_ids: deque[int] = deque()  # sent, not yet answered, oldest first

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
        self._in_flight_step_ids.clear()  # new streams: nothing of the old ones is answered
        return spec

    async def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Sends the step to every rank (a write waits when a rank stops reading: it is bounded too)."""
        if not self.step_timeout_s:
            for worker in self.workers:
                await worker.submit(scheduler_output)
        else:
            try:
                async with asyncio.timeout(self.step_timeout_s):
                    for worker in self.workers:
                        await worker.submit(scheduler_output)
            except TimeoutError:
                raise await self._lost(f"worker did not take step {scheduler_output.step_id}") from None
        self._in_flight_step_ids.append(scheduler_output.step_id)

    async def receive(self) -> ModelRunnerOutput:
        """The output of the oldest step sent and not yet received: every rank's answer is read (so
        a failed rank is noticed), the sampling rank's is returned."""
        step_id = self._in_flight_step_ids.popleft() if self._in_flight_step_ids else -1
        if not self.step_timeout_s:
            return [await w.receive() for w in self.workers][0]
        try:
            async with asyncio.timeout(self.step_timeout_s):
                outputs = [await w.receive() for w in self.workers]
        except TimeoutError:
            raise await self._lost(f"worker did not answer step {step_id}") from None
        return outputs[0]

    async def _lost(self, what: str) -> WorkerUnavailable:
        """Gives up on the ranks: their streams are cancelled (so a worker that runs again drops them
        and takes the next connection); returns the error that says why."""
        self._in_flight_step_ids.clear()
        await self.close()
        return WorkerUnavailable(f"{what} within {self.step_timeout_s:g} s")

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
