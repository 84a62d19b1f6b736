"""Non-streamed responses without stop strings take their engine outputs merged, once, at the end."""
from __future__ import annotations

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
    for token_ids, extras in steps:
        held.token_ids += token_ids
        if extras is not None:
            held.add(extras)
    merged = held.merged("r", steps[-1][1])
    assert merged.new_token_ids == [5, 6, 7] and merged.finish_reason == FinishReason.STOP
    assert merged.stop_reason == 7 and merged.num_cached_tokens == 16 and len(merged.events) == 1


def test_dispatch_holds_final_only_outputs_until_the_finish():
    import asyncio

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
