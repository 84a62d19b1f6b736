"""StepPipeline: a stream's steps run in order in the model thread, queued steps back to back without
a return to the event loop, the outputs in order and ended once the requests have ended; closing or
a stop drops the steps not yet started."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from services.worker.step_pipeline import StepPipeline


def _run(coro):
    return asyncio.run(coro)


class Steps:
    """run_step for the tests: records the thread and which steps ran; `gate` holds step `hold_at`."""

    def __init__(self, hold_at: int | None = None):
        self.ran: list[int] = []
        self.threads: set[str] = set()
        self.hold_at = hold_at
        self.started = threading.Event()
        self.gate = threading.Event()

    def __call__(self, request: int) -> str:
        self.threads.add(threading.current_thread().name)
        if request == self.hold_at:
            self.started.set()
            self.gate.wait(10)
        self.ran.append(request)
        return f"out{request}"


async def _collect(pipeline: StepPipeline) -> list[str]:
    return [out async for out in pipeline.outputs()]


def test_outputs_come_in_order_and_end_after_the_last_request():
    steps = Steps()

    async def main():
        with ThreadPoolExecutor(1, thread_name_prefix="model") as executor:
            pipeline = StepPipeline(steps, executor)
            for i in range(20):
                pipeline.submit(i)
            pipeline.finish()
            return await asyncio.wait_for(_collect(pipeline), 10)

    assert _run(main()) == [f"out{i}" for i in range(20)]
    assert steps.ran == list(range(20))
    assert len(steps.threads) == 1 and next(iter(steps.threads)).startswith("model")


def test_steps_queued_during_a_step_run_without_returning_to_the_loop():
    """While step 0 runs, steps 1-3 arrive; they run in the same drain, one after another, while the
    event loop is blocked and cannot have handed them over."""
    steps = Steps(hold_at=0)
    drains = []

    async def main():
        with ThreadPoolExecutor(1) as executor:
            original_submit = executor.submit

            def counting_submit(fn, *args):
                drains.append(fn)
                return original_submit(fn, *args)

            executor.submit = counting_submit
            pipeline = StepPipeline(steps, executor)
            pipeline.submit(0)
            await asyncio.to_thread(steps.started.wait, 10)
            for i in (1, 2, 3):
                pipeline.submit(i)
            pipeline.finish()
            steps.gate.set()
            return await asyncio.wait_for(_collect(pipeline), 10)

    assert _run(main()) == ["out0", "out1", "out2", "out3"]
    assert len(drains) == 1, "steps queued behind a running one start a second hand-over"


def test_requests_after_an_idle_gap_start_a_new_drain():
    steps = Steps()

    async def main():
        with ThreadPoolExecutor(1) as executor:
            pipeline = StepPipeline(steps, executor)
            outputs = pipeline.outputs()
            pipeline.submit(0)
            first = await asyncio.wait_for(outputs.__anext__(), 10)
            await asyncio.sleep(0.05)  # the drain found nothing more and returned the thread
            pipeline.submit(1)
            pipeline.finish()
            rest = [out async for out in outputs]
            return [first, *rest]

    assert _run(main()) == ["out0", "out1"]


def test_close_drops_the_steps_not_started():
    steps = Steps(hold_at=0)

    async def main():
        with ThreadPoolExecutor(1) as executor:
            pipeline = StepPipeline(steps, executor)
            for i in range(5):
                pipeline.submit(i)
            await asyncio.to_thread(steps.started.wait, 10)
            pipeline.close()
            pipeline.submit(9)  # after close: ignored
            steps.gate.set()
        return steps.ran

    assert _run(main()) == [0]


def test_should_stop_after_a_step_drops_the_rest():
    steps = Steps()

    async def main():
        with ThreadPoolExecutor(1) as executor:
            pipeline = StepPipeline(steps, executor, should_stop=lambda: len(steps.ran) >= 2)
            outputs = pipeline.outputs()
            for i in range(6):
                pipeline.submit(i)
            pipeline.finish()
            got = [await asyncio.wait_for(outputs.__anext__(), 10) for _ in range(2)]
            await asyncio.sleep(0.05)
        return got, steps.ran

    got, ran = _run(main())
    assert got == ["out0", "out1"] and ran == [0, 1]


def test_a_shut_down_executor_ends_the_outputs():
    async def main():
        executor = ThreadPoolExecutor(1)
        executor.shutdown()
        pipeline = StepPipeline(Steps(), executor)
        pipeline.submit(0)
        return await asyncio.wait_for(_collect(pipeline), 10)

    assert _run(main()) == []
