"""The worker side of the engine core: the handshake, the step stream and reconnection, over the
worker ranks that serve one engine.

Each rank is a `WorkerClient`: one, or `--tensor-parallel-size` of them, rank 0 first. A step is
encoded once, by rank 0's client, and the same message goes to every rank; each rank answers every
step, and the output is rank 0's (the sampling rank; the others acknowledge). The KV cache the
scheduler plans with is the smallest any rank reported. At the handshake every rank must report
its own rank, the same world size, model, dtype and shard layout, or it is refused with a message
that says which; then all ranks are initialised at once with a new process-group generation, so
ranks that survived a peer's restart form a new group with it.

Under tensor parallelism a rank that fails a step fails the engine as a lost rank does: the ranks
ran the step's collectives together, so the survivors' state cannot be trusted either. Every rank's
stream is cancelled, WorkerUnavailable says which rank and why, and the next handshake re-forms
the group once every rank answers again.

A rank that neither takes a step nor answers it within `step_timeout_s` (a hung worker: stopped,
deadlocked, its device wedged) is lost exactly as a dead one is: the executor cancels every rank's
stream and raises WorkerUnavailable, and the engine reconnects with back-off. The timeout must
exceed the slowest legitimate step; 0 turns it off.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from typing import Protocol

from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from services.scheduler.worker_client import WorkerStepError, WorkerUnavailable

MIN_RECONNECT_BACKOFF_S = 0.2
MAX_RECONNECT_BACKOFF_S = 5.0


class WorkerLink(Protocol):
    """One worker rank as the executor uses it (`WorkerClient`, or a test's in-process worker)."""

    address: str

    async def connect(self) -> KVCacheSpec: ...

    async def initialize(self, num_blocks: int, rendezvous_addr: str = "", generation: int = 0) -> None: ...

    async def submit(self, scheduler_output: SchedulerOutput) -> object:
        """Sends the step; returns the message sent (what `submit_copy` takes)."""

    async def submit_copy(self, request: object) -> None:
        """Tensor parallelism: sends a step rank 0's link encoded; this rank answers it with an
        acknowledgement (an empty output)."""

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
        self.is_tensor_parallel = len(workers) > 1
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
        check_ranks(specs, [w.address for w in self.workers])
        spec = dataclasses.replace(specs[0], num_blocks=min(s.num_blocks for s in specs))
        if not self.is_tensor_parallel:
            await self.workers[0].initialize(spec.num_blocks)
        else:
            await self._initialize_ranks(spec.num_blocks, f"{_host(self.workers[0].address)}:{spec.tensor_parallel_port}")
        self._backoff_s = MIN_RECONNECT_BACKOFF_S
        self._in_flight_step_ids.clear()  # new streams: nothing of the old ones is answered
        return spec

    async def _initialize_ranks(self, num_blocks: int, rendezvous_addr: str) -> None:
        """All ranks at once (each waits in the rendezvous for the others), under a new generation."""
        generation = time.time_ns()  # new at each handshake, and across scheduler restarts
        results = await asyncio.gather(*(w.initialize(num_blocks, rendezvous_addr, generation) for w in self.workers),
                                       return_exceptions=True)
        for rank, (worker, result) in enumerate(zip(self.workers, results)):
            if isinstance(result, WorkerUnavailable):
                raise WorkerUnavailable(f"rank {rank} at {worker.address}: {result}") from result
            if isinstance(result, BaseException):
                raise result

    async def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Sends the step to every rank (a write waits when a rank stops reading: it is bounded too)."""
        if not self.step_timeout_s:
            await self._submit_all(scheduler_output)
        else:
            try:
                async with asyncio.timeout(self.step_timeout_s):
                    await self._submit_all(scheduler_output)
            except TimeoutError:
                raise await self._lost(f"worker did not take step {scheduler_output.step_id}") from None
        self._in_flight_step_ids.append(scheduler_output.step_id)

    async def receive(self) -> ModelRunnerOutput:
        """The output of the oldest step sent and not yet received: every rank's answer is read (so
        a failed rank is noticed), the sampling rank's is returned."""
        step_id = self._in_flight_step_ids.popleft() if self._in_flight_step_ids else -1
        if not self.step_timeout_s:
            return await self._receive_all(step_id)
        try:
            async with asyncio.timeout(self.step_timeout_s):
                return await self._receive_all(step_id)
        except TimeoutError:
            raise await self._lost(f"worker did not answer step {step_id}") from None

    async def _submit_all(self, scheduler_output: SchedulerOutput) -> None:
        request = await self.workers[0].submit(scheduler_output)
        for worker in self.workers[1:]:
            await worker.submit_copy(request)

    async def _receive_all(self, step_id: int) -> ModelRunnerOutput:
        if not self.is_tensor_parallel:
            return await self.workers[0].receive()
        output, failure = None, None
        for rank, worker in enumerate(self.workers):
            try:
                result = await worker.receive()
            except WorkerUnavailable as exc:
                raise await self._give_up(f"rank {rank} at {worker.address}: {exc}") from None
            except WorkerStepError as exc:  # the others' answers are read still: the streams stay in step
                failure = failure or f"rank {rank} at {worker.address} failed step {step_id}: {exc}"
                continue
            if rank == 0:
                output = result
        if failure is not None:
            raise await self._give_up(f"{failure}; every rank's process group is formed again")
        return output

    async def _lost(self, what: str) -> WorkerUnavailable:
        return await self._give_up(f"{what} within {self.step_timeout_s:g} s")

    async def _give_up(self, why: str) -> WorkerUnavailable:
        """Gives up on the ranks: their streams are cancelled (so a worker that runs again drops them
        and takes the next connection); returns the error that says why."""
        self._in_flight_step_ids.clear()
        await self.close()
        return WorkerUnavailable(why)

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


# What every rank of one engine must agree on, with the words a refusal uses.
RANK_AGREEMENT = (("model_name", "model"), ("dtype", "dtype"), ("shard_layout", "shard layout"),
                  ("vocab_size", "vocabulary size"), ("block_size", "block size"), ("max_model_len", "max_model_len"))


def check_ranks(specs: list[KVCacheSpec], addresses: list[str]) -> None:
    """Raises WorkerUnavailable naming the first rank that is not the rank it was configured as or
    does not match rank 0 (the engine retries, and serves once every rank matches)."""
    world_size = len(specs)
    for rank, (spec, address) in enumerate(zip(specs, addresses, strict=True)):
        where = f"rank {rank} at {address}"
        if spec.tensor_parallel_size != world_size or spec.tensor_parallel_rank != rank:
            raise WorkerUnavailable(
                f"{where} refused: it is rank {spec.tensor_parallel_rank} of {spec.tensor_parallel_size}, the "
                f"scheduler drives {world_size} (--tensor-parallel-size, --worker-addrs)")
        for field, words in RANK_AGREEMENT:
            ours, rank0 = getattr(spec, field), getattr(specs[0], field)
            if ours != rank0:
                raise WorkerUnavailable(f"{where} refused: its {words} {ours!r} differs from rank 0's {rank0!r}")


def _host(address: str) -> str:
    return address.rpartition(":")[0]
