"""The engine client holds a request's outputs between handovers: a non-streamed response without
stop strings takes them merged once, at the end; a streamed one every --stream-interval tokens."""
from __future__ import annotations

import asyncio

from services.common.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    OutputExtras,
    RequestEvent,
    RequestEventType,
)
from services.frontend.engine_client import EngineClient
from services.frontend.held_output import HeldOutput
from tests.step_outputs import outputs_from


def test_held_output_keeps_every_token_and_the_last_finish():
    held = HeldOutput()
    steps = [  # (new tokens, extras) as the engine client's dispatch sees them
        ([], OutputExtras(events=[RequestEvent(RequestEventType.QUEUED, 1.0)], num_cached_tokens=16)),
        ([5], None),
        ([6, 7], OutputExtras(finish_reason=FinishReason.STOP, stop_reason=7)),
    ]
    due = []
    for token_ids, extras in steps:
        held.add(token_ids, extras)
        due.append(held.is_due(extras))
    assert due == [False, False, True]  # final-only: nothing before the finish
    merged = held.take("r", steps[-1][1])
    assert merged.new_token_ids == [5, 6, 7] and merged.finish_reason == FinishReason.STOP
    assert merged.stop_reason == 7 and merged.num_cached_tokens == 16 and len(merged.events) == 1


def test_a_streamed_hold_hands_over_the_first_token_then_every_interval_and_the_finish():
    held = HeldOutput(interval=3)
    handed = []
    steps = [([], None), ([1], None), ([2], None), ([3], None), ([4], OutputExtras(num_cached_tokens=8)),
             ([5], None), ([6], OutputExtras(finish_reason=FinishReason.LENGTH))]
    for token_ids, extras in steps:
        held.add(token_ids, extras)
        if held.is_due(extras):
            output = held.take("r", extras)
            handed.append((output.new_token_ids, output.finish_reason))
    # The prefill step brings no token (nothing to hand over); the first token goes at once (its
    # latency is the time to first token), then three at a time; the finish takes what is left.
    assert handed == [([1], FinishReason.NONE), ([2, 3, 4], FinishReason.NONE), ([5, 6], FinishReason.LENGTH)]
    assert not held.token_ids and held.num_cached_tokens == 8


def test_dispatch_holds_final_only_outputs_until_the_finish():
    async def run():
        client = EngineClient("127.0.0.1:1")
        streamed, final = asyncio.Queue(), asyncio.Queue()
        client._queues.update({"s": streamed, "f": final})
        client._held["f"] = HeldOutput()
        for step, reason in enumerate((FinishReason.NONE, FinishReason.NONE, FinishReason.LENGTH)):
            if reason == FinishReason.NONE:  # plain outputs come in columns
                step_outputs = EngineCoreOutputs(["s", "f"], [[step], [step, 9]])
            else:
                step_outputs = outputs_from([EngineCoreOutput("s", [step]),
                                             EngineCoreOutput("f", [step], finish_reason=reason)])
            client._dispatch(step_outputs)
            if reason == FinishReason.NONE:
                assert final.empty()
        assert streamed.qsize() == 3 and final.qsize() == 1
        assert [(await streamed.get()).new_token_ids for _ in range(3)] == [[0], [1], [2]]
        final_output = await final.get()
        assert final_output.new_token_ids == [0, 9, 1, 9, 2] and final_output.finish_reason == FinishReason.LENGTH
        await client.close()

    asyncio.run(run())


def test_dispatch_hands_a_streamed_request_its_tokens_every_interval():
    async def run():
        client = EngineClient("127.0.0.1:1")
        every, held = asyncio.Queue(), asyncio.Queue()
        client._queues.update({"e": every, "h": held})
        client._send_on(client._latest, "e", 1)
        client._send_on(client._latest, "h", 4)
        for step in range(9):
            if step < 8:
                client._dispatch(EngineCoreOutputs(["e", "h"], [[step], [step]]))
            else:
                client._dispatch(outputs_from([EngineCoreOutput("e", [step], finish_reason=FinishReason.STOP),
                                               EngineCoreOutput("h", [step], finish_reason=FinishReason.STOP)]))
        assert [(await every.get()).new_token_ids for _ in range(9)] == [[i] for i in range(9)]
        outputs = [await held.get() for _ in range(held.qsize())]
        assert [o.new_token_ids for o in outputs] == [[0], [1, 2, 3, 4], [5, 6, 7, 8]]
        assert [o.finished for o in outputs] == [False, False, True]
        await client.close()

    asyncio.run(run())
