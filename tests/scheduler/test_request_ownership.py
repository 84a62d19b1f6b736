"""Request ids are scoped by frontend: a frontend's abort reaches only its own requests, a request id
it already has running is refused without touching that request, and another frontend's request
with the same id runs as a request of its own. The engine core runs on an in-process worker whose
answers can be held back, so the victim is provably mid-flight when the other frontend acts."""
from __future__ import annotations

import asyncio
import contextlib

from services.common.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason, OutputExtras, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import Executor
from services.scheduler.output_router import OutputRouter
from services.worker.fake_runner import FAKE_TOKEN_ID
from tests.scheduler.gated_worker import ClientOutputs, GatedWorker, wait_for


def _request(request_id: str, max_tokens: int, prompt: tuple[int, ...] = (11, 12, 13, 14, 15)) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, list(prompt), params, arrival_time=1.0)


@contextlib.asynccontextmanager
async def _engine(worker: GatedWorker):
    engine = EngineCore(SchedulerConfig(max_num_batched_tokens=64), Executor([worker]))
    task = asyncio.create_task(engine.run(asyncio.Event()))
    await wait_for(lambda: engine.is_worker_alive, "the engine did not connect")
    try:
        yield engine
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _client(engine: EngineCore) -> tuple[int, ClientOutputs]:
    client_id, queue = engine.router.register_client()
    return client_id, ClientOutputs(queue)


async def _mid_flight(worker: GatedWorker, outputs: ClientOutputs, request_id: str) -> None:
    """Waits for the request's first token, then holds every answer back."""
    await wait_for(lambda: outputs.drain() or outputs.tokens.get(request_id), f"{request_id} produced no token")
    worker.gate.clear()


def _assert_completed(output, outputs: ClientOutputs, request_id: str, num_tokens: int) -> None:
    assert output.finish_reason == FinishReason.LENGTH and not output.error_message, output
    assert outputs.tokens[request_id] == [FAKE_TOKEN_ID] * num_tokens


def test_another_frontend_can_neither_abort_nor_take_over_a_running_request():
    async def run():
        worker = GatedWorker()
        async with _engine(worker) as engine:
            victim_id, victim = _client(engine)
            rogue_id, rogue = _client(engine)
            engine.add_request(victim_id, _request("r", max_tokens=12))
            await _mid_flight(worker, victim, "r")
            engine.abort_requests(rogue_id, ["r"])  # not the rogue's: ignored
            engine.add_request(rogue_id, _request("r", max_tokens=3, prompt=(40, 41)))  # a request of its own
            engine.add_request(rogue_id, _request("r", max_tokens=3))  # its own duplicate: refused
            rogue.drain()
            refusal = rogue.finished.pop("r")
            assert refusal.finish_reason == FinishReason.ERROR and refusal.error_code == "invalid_argument"
            assert "duplicate request id 'r'" in refusal.error_message
            rogue.tokens.clear()
            worker.gate.set()
            _assert_completed(await victim.wait_finished("r"), victim, "r", 12)
            _assert_completed(await rogue.wait_finished("r"), rogue, "r", 3)
            await wait_for(lambda: not engine.scheduler.requests, "requests left in the scheduler")
            assert engine.scheduler.kv_cache_manager.num_free_blocks == \
                engine.scheduler.kv_cache_manager.block_pool.num_usable_blocks

    asyncio.run(run())


def test_an_abort_reaches_only_the_callers_request_of_that_id():
    async def run():
        worker = GatedWorker()
        async with _engine(worker) as engine:
            victim_id, victim = _client(engine)
            rogue_id, rogue = _client(engine)
            engine.add_request(victim_id, _request("r", max_tokens=12))
            await _mid_flight(worker, victim, "r")
            engine.add_request(rogue_id, _request("r", max_tokens=30))
            worker.gate.set()
            await _mid_flight(worker, rogue, "r")
            assert "r" not in victim.finished
            engine.abort_requests(rogue_id, ["r"])
            worker.gate.set()
            _assert_completed(await victim.wait_finished("r"), victim, "r", 12)
            await wait_for(lambda: not engine.scheduler.requests, "the rogue's request was not aborted")
            rogue.drain()
            assert "r" not in rogue.finished and len(rogue.tokens["r"]) < 30  # aborted: no more outputs

    asyncio.run(run())


def test_an_aborted_id_can_be_reused_and_gets_none_of_the_old_requests_tokens():
    """The old request's steps still in flight carry its tokens: they go nowhere, not to the new one."""
    async def run():
        worker = GatedWorker()
        async with _engine(worker) as engine:
            client_id, outputs = _client(engine)
            engine.add_request(client_id, _request("r", max_tokens=40))
            await _mid_flight(worker, outputs, "r")  # two steps in flight with the old request's tokens
            engine.abort_requests(client_id, ["r"])
            outputs.tokens.clear()
            engine.add_request(client_id, _request("r", max_tokens=4))
            worker.gate.set()
            _assert_completed(await outputs.wait_finished("r"), outputs, "r", 4)  # exactly its own 4

    asyncio.run(run())


def test_a_frontend_that_leaves_takes_only_its_own_requests():
    async def run():
        worker = GatedWorker()
        async with _engine(worker) as engine:
            staying_id, staying = _client(engine)
            leaving_id, _ = _client(engine)
            engine.add_request(staying_id, _request("r", max_tokens=10))
            engine.add_request(leaving_id, _request("r", max_tokens=100))
            await _mid_flight(worker, staying, "r")
            engine.unregister_client(leaving_id)
            worker.gate.set()
            _assert_completed(await staying.wait_finished("r"), staying, "r", 10)
            await wait_for(lambda: not engine.scheduler.requests, "the leaving frontend's request still runs")

    asyncio.run(run())


def test_the_router_names_an_aliased_request_by_its_frontends_id():
    async def run():
        router = OutputRouter()
        (one, q1), (two, q2) = router.register_client(), router.register_client()
        assert router.own("x", one) == "x"
        alias = router.own("x", two)
        assert alias not in (None, "x") and router.own("x", two) is None  # a duplicate of client two's
        assert router.engine_id(one, "x") == "x" and router.engine_id(two, "x") == alias
        assert router.release(two, ["unknown", "y"]) == []  # ids the client does not own: nothing
        done = OutputExtras(finish_reason=FinishReason.LENGTH)
        router.publish(EngineCoreOutputs([alias], [[7]], {alias: done}), None)  # one client's step
        step = q2.get_nowait()
        assert (step.req_ids, step.new_token_ids, step.extras) == (["x"], [[7]], {"x": done})
        assert q1.empty() and router.engine_id(two, "x") is None  # finished: forgotten, alias and all
        assert router.own("x", two) == "x#2.1"  # "x" is still client one's; the next alias is the same shape
        assert router.release(two, ["x"]) == ["x#2.1"] and router.owner("x#2.1") is None
        assert router.own("x", two) == "x#2.2"  # released: id free for the client, engine id still taken
        router.disown(["x#2.1"])
        assert router.owner("x") == one

    asyncio.run(run())
