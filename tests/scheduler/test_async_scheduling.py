"""Async scheduling: the next step is scheduled before the last one's output is back.

A worker stand-in samples a token that depends only on the position (and EOS at a set output
index), so a pipelined run must give every request exactly the tokens and finish of a run that
waits for each output, through chunked prefill, stop tokens, length limits and preemption, and
leave no block held and no request state on the worker. Steps and outputs cross the step stream's
codec, so the worker decodes each step complete, with the scheduler's counts, in every case.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict, deque

import pytest
import torch

from services.common import worker_codec
from services.common.messages import EngineCoreRequest, FinishReason, KVCacheSpec, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import Executor
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.fake_runner import FakeModelRunner
from services.worker.kv_cache import KVCacheLayout
from tests.step_outputs import per_request

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


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def _assert_decoded_as_scheduled(decoded, so) -> None:
    """What the worker's end decoded is the scheduler's step, whatever the message left out."""
    d, c = decoded.scheduled_cached_reqs, so.scheduled_cached_reqs
    assert (d.req_ids, d.num_computed_tokens, d.new_block_ids, d.resumed_from_preemption) == \
        (c.req_ids, c.num_computed_tokens, c.new_block_ids, c.resumed_from_preemption)
    assert d.resumed_token_ids[:len(c.resumed_token_ids)] == c.resumed_token_ids  # the resumed ones come first
    assert list(decoded.num_scheduled_tokens.items()) == list(so.num_scheduled_tokens.items())
    assert decoded.scheduled_new_reqs == so.scheduled_new_reqs


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
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    # Whether each step went without ids and counts, and whether its requests were the last step's.
    elided, same_requests, last_order = [], [], []
    for _ in range(2000):
        if not (scheduler.has_unfinished_requests() or scheduler.finished_req_ids or in_flight):
            # The scheduler's counts followed the rule in every step with the last step's requests
            # (pipelined too: a step's tokens count as computed once scheduled), so each was elided.
            assert elided == same_requests and sum(elided) > 0
            return tokens, finishes, scheduler, runner
        if scheduler.has_unfinished_requests() or scheduler.finished_req_ids:
            so = scheduler.schedule()
            msg = _wire(encoder.encode(so))
            decoded = decoder.decode(msg)
            _assert_decoded_as_scheduled(decoded, so)
            cached = so.scheduled_cached_reqs
            elided.append(msg.scheduled_cached_reqs.req_ids_as_last_step)
            same_requests.append(bool(last_order) and not so.scheduled_new_reqs
                                 and not any(cached.resumed_from_preemption) and cached.req_ids == last_order)
            last_order = [r.req_id for r in so.scheduled_new_reqs] + cached.req_ids
            # The worker runs steps in the order sent; the answer is read later.
            in_flight.append((so, _wire(decoder.encode_output(runner.execute_model(decoded)))))
            if pipelined and len(in_flight) < 2 and so.total_num_scheduled_tokens:
                continue
        so, answer = in_flight.popleft()
        ro = encoder.decode_output(answer)
        assert ro.step_id == so.step_id
        for output in per_request(scheduler.update_from_output(so, ro)):
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
    """The WorkerClient interface over a FakeModelRunner: each step runs as it is submitted, and
    steps and answers cross the step stream's codec as over gRPC."""

    address = "in-process"

    def __init__(self):
        self.runner = FakeModelRunner(KVCacheLayout(2, 1, 8, BLOCK_SIZE, torch.float32))
        self.outputs: deque = deque()
        self.max_in_flight = 0

    async def connect(self) -> KVCacheSpec:
        return KVCacheSpec(BLOCK_SIZE, 64, 1024, 256, "fake", "cpu", "float32", 1000, "none")

    async def initialize(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.steps, self.worker_end = worker_codec.StepEncoder(), worker_codec.StepDecoder()  # a new stream

    async def submit(self, scheduler_output) -> None:
        decoded = self.worker_end.decode(_wire(self.steps.encode(scheduler_output)))
        _assert_decoded_as_scheduled(decoded, scheduler_output)
        self.outputs.append(_wire(self.worker_end.encode_output(self.runner.execute_model(decoded))))
        self.max_in_flight = max(self.max_in_flight, len(self.outputs))

    async def receive(self):
        await asyncio.sleep(0)  # the output comes back later, as over gRPC
        return self.steps.decode_output(self.outputs.popleft())

    def is_stream_open(self) -> bool:
        return True


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_core_keeps_at_most_two_steps_in_flight_and_drains_them(async_scheduling, monkeypatch):
    update_from_output = Scheduler.update_from_output

    def paired(scheduler, so, ro):
        assert ro.step_id == so.step_id  # each output meets the step it answers
        return update_from_output(scheduler, so, ro)

    monkeypatch.setattr(Scheduler, "update_from_output", paired)

    async def run():
        worker = InProcessWorker()
        engine = EngineCore(SchedulerConfig(max_num_batched_tokens=16, async_scheduling=async_scheduling),
                            Executor([worker]))
        client_id, queue = engine.router.register_client()
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
            for output in per_request(step):
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
