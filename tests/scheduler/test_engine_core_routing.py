"""EngineCore routes each step's outputs to the frontends that own the requests: one message each."""
from __future__ import annotations

import asyncio

from services.common.messages import EngineCoreOutputs, FinishReason, OutputExtras
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


def test_columns_and_extras_reach_their_own_frontend():
    async def run():
        engine, queues = _engine_with_clients({"a1": 1, "a2": 1, "b1": 2, "b2": 2})
        finished = OutputExtras(finish_reason=FinishReason.LENGTH)
        engine._publish(EngineCoreOutputs(["a1", "b1", "b2", "a2", "gone"], [[1], [2], [9], [3, 4], [5]],
                                          {"b2": finished}), None)
        first, second = queues[1].get_nowait(), queues[2].get_nowait()
        assert queues[1].empty() and queues[2].empty()
        assert (first.req_ids, first.new_token_ids, first.extras) == (["a1", "a2"], [[1], [3, 4]], {})
        assert (second.req_ids, second.new_token_ids, second.extras) == (["b1", "b2"], [[2], [9]], {"b2": finished})
        assert "b2" not in engine._req_client  # a finished request is forgotten
        assert first.timestamp > 0 and second.timestamp == first.timestamp

    asyncio.run(run())


def test_one_frontend_takes_the_columns_as_they_are():
    async def run():
        engine, queues = _engine_with_clients({"a1": 1, "a2": 1})
        step = EngineCoreOutputs(["a1", "a2"], [[1], [2]])
        engine._publish(step, None)
        routed = queues[1].get_nowait()
        assert routed is step
        assert queues[2].empty()
        engine._publish(EngineCoreOutputs(), None)  # nothing to send: no message
        assert queues[1].empty() and queues[2].empty()

    asyncio.run(run())
