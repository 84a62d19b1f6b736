"""A worker that stops answering (stopped, deadlocked) is lost exactly as a dead one is: the step
timeout ends its in-flight requests with a clear error, health turns NOT_SERVING, the streams are
given up, and the engine reconnects with back-off, through refusals while the worker still holds
its old stream, and serves again once the worker answers."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.common.messages import (
    EngineCoreRequest,
    FinishReason,
    KVCacheSpec,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import Executor
from services.scheduler.worker_client import WorkerUnavailable
from services.worker.fake_runner import FAKE_TOKEN_ID
from tests.scheduler.gated_worker import ClientOutputs, GatedWorker, wait_for

STEP_TIMEOUT_S = 0.5


class SilentRank:
    """A rank that takes steps but answers none (or, with `is_full`, does not take them either)."""

    address = "silent"

    def __init__(self, is_full: bool = False):
        self.is_full = is_full
        self.num_closes = 0

    async def connect(self) -> KVCacheSpec:
        return KVCacheSpec(16, 64, 1024, 256, "m", "cpu", "float32", 100, "none")

    async def initialize(self, num_blocks: int) -> None:
        pass

    async def submit(self, scheduler_output) -> None:
        if self.is_full:  # flow control: the write waits for a reader that never comes
            await asyncio.Event().wait()

    async def receive(self) -> ModelRunnerOutput:
        await asyncio.Event().wait()

    def is_stream_open(self) -> bool:
        return True

    async def close(self) -> None:
        self.num_closes += 1


def test_a_step_not_answered_in_time_loses_the_worker_and_gives_its_stream_up():
    async def run():
        rank = SilentRank()
        executor = Executor([rank], step_timeout_s=STEP_TIMEOUT_S)
        await executor.start()
        await executor.submit(SchedulerOutput(step_id=41))
        with pytest.raises(WorkerUnavailable, match=r"^worker did not answer step 41 within 0.5 s$"):
            await asyncio.wait_for(executor.receive(), 30)
        assert rank.num_closes == 1  # the stream is cancelled, not left to the worker

    asyncio.run(run())


def test_a_step_the_worker_does_not_take_in_time_loses_it_too():
    async def run():
        rank = SilentRank(is_full=True)
        executor = Executor([rank], step_timeout_s=STEP_TIMEOUT_S)
        await executor.start()
        with pytest.raises(WorkerUnavailable, match=r"^worker did not take step 7 within 0.5 s$"):
            await asyncio.wait_for(executor.submit(SchedulerOutput(step_id=7)), 30)
        assert rank.num_closes == 1

    asyncio.run(run())


def test_a_negative_step_timeout_is_refused():
    with pytest.raises(ValueError, match="step_timeout_s"):
        Executor([SilentRank()], step_timeout_s=-1)


def test_a_hung_worker_fails_its_requests_and_the_engine_recovers_once_it_answers():
    async def run():
        worker = GatedWorker()
        health: list[bool] = []
        executor = Executor([worker], step_timeout_s=STEP_TIMEOUT_S)
        engine = EngineCore(SchedulerConfig(max_num_batched_tokens=64), executor, on_health_change=health.append)
        task = asyncio.create_task(engine.run(asyncio.Event()))
        try:
            await wait_for(lambda: engine.is_worker_alive, "the engine did not connect")
            client_id, queue = engine.router.register_client()
            outputs = ClientOutputs(queue)
            params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
            engine.add_request(client_id, EngineCoreRequest("long", [11, 12, 13], params, 1.0))
            await wait_for(lambda: outputs.drain() or outputs.tokens.get("long"), "no token")
            # The worker stops: no answer comes, and while it stays stopped it answers no handshake either.
            worker.gate.clear()
            worker.is_hung = True
            failed = await outputs.wait_finished("long", timeout_s=30, poll_s=0.01)
            assert failed.finish_reason == FinishReason.ERROR and failed.error_code == "unavailable"
            assert "worker unavailable: worker did not answer step" in failed.error_message
            assert failed.error_message.endswith(f"within {STEP_TIMEOUT_S:g} s")
            assert health == [True, False] and not engine.is_worker_alive
            assert worker.num_closes >= 1 and not worker.is_stream_open()
            await wait_for(lambda: worker.num_connects >= 2, "the engine did not retry", timeout_s=30, poll_s=0.01)

            # It runs again, but refuses a new stream while it still holds the old one: twice.
            worker.num_initialize_refusals = 2
            worker.is_hung = False
            worker.gate.set()
            await wait_for(lambda: engine.is_worker_alive, "the engine did not reconnect", timeout_s=30, poll_s=0.01)
            assert worker.num_initialize_refusals == 0 and health == [True, False, True]
            engine.add_request(client_id, EngineCoreRequest(
                "after", [11, 12, 13], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), 2.0))
            done = await outputs.wait_finished("after")
            assert done.finish_reason == FinishReason.LENGTH and outputs.tokens["after"] == [FAKE_TOKEN_ID] * 5
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())


def test_no_timeout_means_a_slow_step_is_waited_for():
    async def run():
        worker = GatedWorker()
        engine = EngineCore(SchedulerConfig(), Executor([worker], step_timeout_s=0))
        task = asyncio.create_task(engine.run(asyncio.Event()))
        try:
            await wait_for(lambda: engine.is_worker_alive, "the engine did not connect")
            client_id, queue = engine.router.register_client()
            outputs = ClientOutputs(queue)
            worker.gate.clear()
            engine.add_request(client_id, EngineCoreRequest(
                "slow", [11, 12], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), 1.0))
            await asyncio.sleep(2 * STEP_TIMEOUT_S)  # longer than the timeout the other tests use
            assert engine.is_worker_alive and outputs.queue.empty()
            worker.gate.set()
            assert (await outputs.wait_finished("slow")).finish_reason == FinishReason.LENGTH
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())
