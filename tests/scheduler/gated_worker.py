"""An in-process worker for engine-core tests, with the controls a hostile or broken world needs:
a gate that holds every answer back (a worker that is slow, or stopped), and refusals at connect and
at initialize (a worker that does not answer, or still holds an old stream). Steps and answers
cross the real step-stream codec, serialized, and run on the fake model runner."""
from __future__ import annotations

import asyncio
from collections import deque

import torch

from services.common import worker_codec
from services.common.messages import EngineCoreOutputs, KVCacheSpec, SamplingParams
from services.scheduler.worker_client import WorkerUnavailable
from services.worker.fake_runner import FakeModelRunner
from services.worker.kv_cache import KVCacheLayout
from tests.step_outputs import per_request

BLOCK_SIZE = 4
VOCAB_SIZE = 1000
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


class GatedWorker:
    """A `WorkerLink`. Each step runs when it is submitted; its answer is read only while `gate` is open."""

    address = "in-process"

    def __init__(self):
        self.runner = FakeModelRunner(KVCacheLayout(2, 1, 8, BLOCK_SIZE, torch.float32), vocab_size=VOCAB_SIZE)
        self.gate = asyncio.Event()
        self.gate.set()
        self.is_hung = False  # connect times out, as with a stopped worker
        self.num_initialize_refusals = 0  # initialize refuses this many more times (an old stream is active)
        self.num_connects = self.num_closes = 0
        self._answers: deque = deque()
        self._open = False

    async def connect(self) -> KVCacheSpec:
        self.num_connects += 1
        if self.is_hung:
            raise WorkerUnavailable("worker at in-process: DEADLINE_EXCEEDED")
        return KVCacheSpec(BLOCK_SIZE, 256, 1024, 512, "fake", "cpu", "float32", VOCAB_SIZE, "none")

    async def initialize(self, num_blocks: int) -> None:
        if self.num_initialize_refusals:
            self.num_initialize_refusals -= 1
            raise WorkerUnavailable("worker at in-process: FAILED_PRECONDITION another stream is active")
        self.runner.initialize_kv_cache(num_blocks)
        self._steps, self._worker_end = worker_codec.StepEncoder(), worker_codec.StepDecoder()
        self._answers.clear()
        self._open = True

    async def submit(self, scheduler_output) -> None:
        step = self._worker_end.decode(_wire(self._steps.encode(scheduler_output)))
        self._answers.append(_wire(self._worker_end.encode_output(self.runner.execute_model(step))))

    async def receive(self):
        await asyncio.sleep(0)  # the answer comes back later, as over gRPC: the test's coroutine runs between steps
        await self.gate.wait()
        return self._steps.decode_output(self._answers.popleft())

    def is_stream_open(self) -> bool:
        return self._open

    async def close(self) -> None:
        self.num_closes += 1
        self._open = False


async def wait_for(condition, what: str, timeout_s: float = 10.0, poll_s: float = 0.0) -> None:
    """Checks `condition` until true: by default once per turn of the event loop (so between any two
    engine steps), else every `poll_s`; the bound is generous, not a timing claim."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(poll_s)


class ClientOutputs:
    """What one frontend's queue delivered, per request: tokens, and the finishing output."""

    def __init__(self, queue: asyncio.Queue[EngineCoreOutputs | None]):
        self.queue = queue
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}  # request id -> its finishing EngineCoreOutput
        self.num_outputs: dict[str, int] = {}

    def drain(self) -> None:
        while not self.queue.empty():
            step = self.queue.get_nowait()
            for output in per_request(step):
                assert output.request_id not in self.finished, f"{output.request_id}: an output after its finish"
                self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                self.num_outputs[output.request_id] = self.num_outputs.get(output.request_id, 0) + 1
                if output.finished:
                    self.finished[output.request_id] = output

    async def wait_finished(self, request_id: str, timeout_s: float = 10.0, poll_s: float = 0.0):
        def done() -> bool:
            self.drain()
            return request_id in self.finished
        await wait_for(done, f"{request_id} did not finish", timeout_s, poll_s)
        return self.finished[request_id]
