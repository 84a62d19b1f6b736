"""The output router sends each step's outputs to the frontends that own the requests: one message each."""
from __future__ import annotations

import asyncio

from services.common.messages import EngineCoreOutputs, FinishReason, OutputExtras, SchedulerStats
from services.scheduler.output_router import OutputRouter, error_outputs


def _router_with_clients(owners: dict[str, int]) -> tuple[OutputRouter, dict[int, asyncio.Queue]]:
    router = OutputRouter()
    queues = {}
    for _ in range(2):
        client_id, queue = router.register_client()
        queues[client_id] = queue
    for request_id, client_id in owners.items():
        router.own(request_id, client_id)
    return router, queues


def test_columns_and_extras_reach_their_own_frontend():
    async def run():
        router, queues = _router_with_clients({"a1": 1, "a2": 1, "b1": 2, "b2": 2})
        finished = OutputExtras(finish_reason=FinishReason.LENGTH)
        stats = SchedulerStats(num_running_reqs=3)
        router.publish(EngineCoreOutputs(["a1", "b1", "b2", "a2", "gone"], [[1], [2], [9], [3, 4], [5]],
                                         {"b2": finished}), stats)
        first, second = queues[1].get_nowait(), queues[2].get_nowait()
        assert queues[1].empty() and queues[2].empty()
        assert (first.req_ids, first.new_token_ids, first.extras) == (["a1", "a2"], [[1], [3, 4]], {})
        assert (second.req_ids, second.new_token_ids, second.extras) == (["b1", "b2"], [[2], [9]], {"b2": finished})
        assert router.owner("b2") is None and router.owner("b1") == 2  # a finished request is forgotten
        assert first.scheduler_stats is stats and second.scheduler_stats is stats
        assert first.timestamp > 0 and second.timestamp == first.timestamp

    asyncio.run(run())


def test_one_frontend_takes_the_columns_as_they_are():
    async def run():
        router, queues = _router_with_clients({"a1": 1, "a2": 1})
        step = EngineCoreOutputs(["a1", "a2"], [[1], [2]])
        router.publish(step, None)
        assert queues[1].get_nowait() is step
        assert queues[2].empty()
        router.publish(EngineCoreOutputs(), None)  # nothing to send: no message
        assert queues[1].empty() and queues[2].empty()

    asyncio.run(run())


def test_a_frontend_that_leaves_hands_back_its_requests():
    async def run():
        router, queues = _router_with_clients({"a1": 1, "b1": 2, "a2": 1})
        assert router.unregister_client(1) == ["a1", "a2"]
        assert router.owner("a1") is None and router.owner("b1") == 2
        router.publish(EngineCoreOutputs(["a1", "b1"], [[1], [2]]), None)
        assert queues[2].get_nowait().req_ids == ["b1"]
        router.send(1, error_outputs(["late"], "gone", "unavailable"))  # to a frontend that left: dropped
        router.send(2, error_outputs(["r"], "the worker is unavailable", "unavailable"))
        refused = queues[2].get_nowait()
        assert refused.req_ids == ["r"] and refused.extras["r"].finish_reason == FinishReason.ERROR
        assert (refused.extras["r"].error_message, refused.extras["r"].error_code) == \
            ("the worker is unavailable", "unavailable")

    asyncio.run(run())
