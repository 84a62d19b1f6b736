"""The executor drives every worker rank: each step goes to all of them, each answer is read, the
first rank's output is the step's, and the KV cache is the smallest any rank can hold."""
from __future__ import annotations

import asyncio

import pytest

from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from services.scheduler.executor import MAX_RECONNECT_BACKOFF_S, Executor


class FakeRank:
    def __init__(self, address: str, num_blocks: int, rank: int = 0, world_size: int = 1):
        self.address = address
        self.num_blocks = num_blocks
        self.rank, self.world_size = rank, world_size
        self.initialized: list[int] = []
        self.steps: list[int] = []
        self.is_open = True

    async def connect(self) -> KVCacheSpec:
        return KVCacheSpec(16, self.num_blocks, 1024, 256, "m", "cpu", "float32", 100, "none",
                           tensor_parallel_rank=self.rank, tensor_parallel_size=self.world_size)

    async def initialize(self, num_blocks: int, rendezvous_addr: str = "", generation: int = 0) -> None:
        self.initialized.append(num_blocks)

    async def submit(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        self.steps.append(scheduler_output.step_id)
        return scheduler_output  # what the other ranks are sent

    async def submit_copy(self, scheduler_output: SchedulerOutput) -> None:
        self.steps.append(scheduler_output.step_id)

    async def receive(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[self.address], step_id=self.steps.pop(0))

    def is_stream_open(self) -> bool:
        return self.is_open

    async def close(self) -> None:
        self.is_open = False


def test_every_rank_gets_each_step_and_the_first_rank_answers():
    async def run():
        ranks = [FakeRank("rank0", 100, 0, 2), FakeRank("rank1", 80, 1, 2)]
        executor = Executor(ranks)
        spec = await executor.start()
        assert spec.num_blocks == 80 and [r.initialized for r in ranks] == [[80], [80]]
        await executor.submit(SchedulerOutput(step_id=1))
        await executor.submit(SchedulerOutput(step_id=2))
        first = await executor.receive()
        assert (first.req_ids, first.step_id) == (["rank0"], 1)
        assert ranks[1].steps == [2]  # rank 1's answer to step 1 was read too
        assert executor.is_alive() and executor.address == "rank0,rank1"
        ranks[1].is_open = False
        assert not executor.is_alive()
        await executor.close()
        assert not ranks[0].is_open

    asyncio.run(run())


def test_reconnect_back_off_doubles_to_its_limit_and_stop_cuts_it_short():
    async def run():
        executor = Executor([FakeRank("rank0", 10)])
        stop = asyncio.Event()
        stop.set()  # returns at once, but the back-off still grows
        waits = [await executor.wait_before_retry(stop) for _ in range(7)]
        assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, MAX_RECONNECT_BACKOFF_S, MAX_RECONNECT_BACKOFF_S]
        await executor.start()  # a good start resets it
        assert await executor.wait_before_retry(stop) == 0.2

    asyncio.run(run())


def test_an_executor_needs_a_worker():
    with pytest.raises(ValueError):
        Executor([])
