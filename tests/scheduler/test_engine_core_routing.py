"""EngineCore routes each step's outputs to the frontends that own the requests: one message each."""
from __future__ import annotations

import asyncio

from services.common.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_core import EngineCore


def _engine_with_clients(owners: dict[str, int]) -> tuple[EngineCore, dict[int, asyncio.Queue]]:
    engine = EngineCore(SchedulerConfig(), worker=None)
    queues = {}
    for _ in range(2):
        client_id, queue = engine.register_client()
        queues[client_id] = queue
    engine._req_client.update(owners)
    return engine, queues


def test_plain_columns_and_full_outputs_reach_their_own_frontend():
    async def run():
        engine, queues = _engine_with_clients({"a1": 1, "a2": 1, "b1": 2, "b2": 2})
        engine._publish(EngineCoreOutputs(
            [EngineCoreOutput("b2", [9], finish_reason=FinishReason.LENGTH)],
            plain_req_ids=["a1", "b1", "a2", "gone"], plain_token_ids=[[1], [2], [3, 4], [5]]), None)
        first, second = queues[1].get_nowait(), queues[2].get_nowait()
        assert queues[1].empty() and queues[2].empty()
        assert first.outputs == [] and first.plain_req_ids == ["a1", "a2"] and first.plain_token_ids == [[1], [3, 4]]
        assert second.plain_req_ids == ["b1"] and second.plain_token_ids == [[2]]
        assert [o.request_id for o in second.outputs] == ["b2"]
        assert "b2" not in engine._req_client  # a finished request is forgotten
        assert first.timestamp > 0 and second.timestamp == first.timestamp

    asyncio.run(run())


def test_one_frontend_takes_the_columns_as_they_are():
    async def run():
        engine, queues = _engine_with_clients({"a1": 1, "a2": 1})
        step = EngineCoreOutputs(plain_req_ids=["a1", "a2"], plain_token_ids=[[1], [2]])
        engine._publish(step, None)
        routed = queues[1].get_nowait()
        assert routed.plain_req_ids is step.plain_req_ids and routed.plain_token_ids is step.plain_token_ids
        assert queues[2].empty()
        engine._publish(EngineCoreOutputs(), None)  # nothing to send: no message
        assert queues[1].empty() and queues[2].empty()

    asyncio.run(run())
