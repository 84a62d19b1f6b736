"""Async scheduling: the next step is scheduled before the last one's output is back.

A worker stand-in samples a token that depends only on the position (and EOS at a set output
index), so a pipelined run must give every request exactly the tokens and finish of a run that
waits for each output, through chunked prefill, stop tokens, length limits and preemption, and
leave no block held and no request state on the worker.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict, deque

import pytest
import torch

from services.common.messages import EngineCoreRequest, FinishReason, KVCacheSpec, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_core import EngineCore
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.fake_runner import FakeModelRunner
from services.worker.kv_cache import KVCacheLayout

EOS = 2
BLOCK_SIZE = 4


class ScriptedRunner(FakeModelRunner):
    """Samples 10 + position % 7, or EOS when a request reaches its `eos_at` length."""

    def __init__(self, eos_at: dict[str, int]):
        super().__init__(KVCacheLayout(2, 1, 8, BLOCK_SIZE, torch.float32))
        self.eos_at = eos_at

    def execute_model(self, so):
        out = super().execute_model(so)
        for i, (req_id, token_ids) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            if token_ids:
                num_tokens = self.requests[req_id].num_tokens  # counts the token just sampled
                out.sampled_token_ids[i] = [EOS if num_tokens == self.eos_at.get(req_id) else 10 + num_tokens % 7]
        return out


def _requests() -> list[Request]:
    specs = [("a", 23, 9), ("b", 5, 14), ("c", 41, 6), ("d", 2, 11), ("e", 17, 1), ("f", 30, 8)]
    return [Request(EngineCoreRequest(req_id, [100 + (7 * i + j) % 50 for j in range(prompt_len)],
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens), float(i),
                                      eos_token_ids=(EOS,)))
            for i, (req_id, prompt_len, max_tokens) in enumerate(specs)]


def _run(num_blocks: int, pipelined: bool) -> tuple[dict, dict, Scheduler, ScriptedRunner]:
    requests = _requests()
    # b stops on EOS after 7 tokens of its 14; d's EOS comes after its length limit, so it never shows.
    runner = ScriptedRunner({"b": 5 + 7, "d": 2 + 12})
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32), num_blocks, BLOCK_SIZE, max_model_len=256)
    for request in requests:
        scheduler.add_request(request)
    tokens: dict[str, list[int]] = defaultdict(list)
    finishes: dict[str, FinishReason] = {}
    in_flight: deque = deque()
    for _ in range(2000):
        if not (scheduler.has_unfinished_requests() or scheduler.finished_req_ids or in_flight):
            return tokens, finishes, scheduler, runner
        if scheduler.has_unfinished_requests() or scheduler.finished_req_ids:
            so = scheduler.schedule()
            in_flight.append((so, runner.execute_model(so)))  # the worker runs steps in the order sent
            if pipelined and len(in_flight) < 2 and so.total_num_scheduled_tokens:
                continue
        so, ro = in_flight.popleft()
        for output in scheduler.update_from_output(so, ro).all_outputs():
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                assert output.request_id not in finishes
                finishes[output.request_id] = output.finish_reason
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("num_blocks", [200, 13, 14])  # 13 or 14 blocks of 4 tokens: preemption
def test_pipelined_steps_give_the_tokens_of_waiting_for_each_output(num_blocks):
    sync_tokens, sync_finishes, _, _ = _run(num_blocks, pipelined=False)
    tokens, finishes, scheduler, runner = _run(num_blocks, pipelined=True)
    assert tokens == sync_tokens and finishes == sync_finishes
    assert finishes == {"a": FinishReason.LENGTH, "b": FinishReason.STOP, "c": FinishReason.LENGTH,
                        "d": FinishReason.LENGTH, "e": FinishReason.LENGTH, "f": FinishReason.LENGTH}
    assert {r: len(t) for r, t in tokens.items()} == {"a": 9, "b": 7, "c": 6, "d": 11, "e": 1, "f": 8}
    assert tokens["b"][-1] == EOS and EOS not in tokens["d"]
    if num_blocks < 200:
        assert scheduler.num_preemptions > 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks and not scheduler.kv_cache_manager.req_to_blocks
    assert runner.requests == {}  # every finish reached the worker


def test_a_step_in_flight_that_samples_the_last_token_is_not_followed_by_another():
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    scheduler = Scheduler(SchedulerConfig(), num_blocks=20, block_size=BLOCK_SIZE, max_model_len=64)
    scheduler.add_request(Request(EngineCoreRequest("r", [5, 6, 7], params, 0.0)))
    first = scheduler.schedule()  # the prompt; samples output token 1
    second = scheduler.schedule()  # output token 1 in flight: computes it and samples token 2, the last
    third = scheduler.schedule()  # token 2 in flight would end the request: nothing to schedule
    assert first.num_scheduled_tokens == {"r": 3} and second.num_scheduled_tokens == {"r": 1}
    assert third.total_num_scheduled_tokens == 0


class InProcessWorker:
    """The WorkerClient interface over a FakeModelRunner: each step runs as it is submitted."""

    address = "in-process"

    def __init__(self):
        self.runner = FakeModelRunner(KVCacheLayout(2, 1, 8, BLOCK_SIZE, torch.float32))
        self.outputs: deque = deque()
        self.max_in_flight = 0

    async def connect(self) -> KVCacheSpec:
        return KVCacheSpec(BLOCK_SIZE, 64, 1024, 256, "fake", "cpu", "float32", 1000, "none")

    async def initialize(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    async def submit(self, scheduler_output) -> None:
        self.outputs.append(self.runner.execute_model(scheduler_output))
        self.max_in_flight = max(self.max_in_flight, len(self.outputs))

    async def receive(self, step):
        await asyncio.sleep(0)  # the output comes back later, as over gRPC
        output = self.outputs.popleft()
        assert output.step_id == step.step_id  # outputs come back in the order the steps went out
        return output

    def is_stream_open(self) -> bool:
        return True


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_core_keeps_at_most_two_steps_in_flight_and_drains_them(async_scheduling):
    async def run():
        worker = InProcessWorker()
        engine = EngineCore(SchedulerConfig(max_num_batched_tokens=16, async_scheduling=async_scheduling), worker)
        client_id, queue = engine.register_client()
        stop = asyncio.Event()
        task = asyncio.create_task(engine.run(stop))
        while not engine.is_worker_alive:
            await asyncio.sleep(0)
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        for i in range(3):
            engine.add_request(client_id, EngineCoreRequest(f"r{i}", list(range(100, 120 + i)), params, 0.0))
        tokens: dict[str, list[int]] = defaultdict(list)
        finished: set[str] = set()
        while len(finished) < 3:
            step = await asyncio.wait_for(queue.get(), 10)
            for output in step.all_outputs():
                tokens[output.request_id] += output.new_token_ids
                if output.finished:
                    finished.add(output.request_id)
        stop.set()
        engine.wake()
        await asyncio.wait_for(task, 10)
        assert {r: len(t) for r, t in tokens.items()} == {"r0": 5, "r1": 5, "r2": 5}
        assert worker.max_in_flight == (2 if async_scheduling else 1)
        assert not worker.outputs and worker.runner.requests == {}  # drained; the finishes reached the worker
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks

    asyncio.run(run())
