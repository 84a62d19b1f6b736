"""Non-streamed responses without stop strings take their engine outputs merged, once, at the end."""
from __future__ import annotations

from services.common.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, RequestEvent, RequestEventType
from services.frontend.engine_client import EngineClient, merge_outputs


def test_merge_outputs_keeps_every_token_and_the_last_finish():
    merged = merge_outputs([
        EngineCoreOutput("r", [], events=[RequestEvent(RequestEventType.QUEUED, 1.0)], num_cached_tokens=16),
        EngineCoreOutput("r", [5], num_cached_tokens=16),
        EngineCoreOutput("r", [6, 7], finish_reason=FinishReason.STOP, stop_reason=7),
    ])
    assert merged.new_token_ids == [5, 6, 7] and merged.finish_reason == FinishReason.STOP
    assert merged.stop_reason == 7 and merged.num_cached_tokens == 16 and len(merged.events) == 1


def test_dispatch_holds_final_only_outputs_until_the_finish():
    import asyncio

    async def run():
        client = EngineClient("127.0.0.1:1")
        streamed, final = asyncio.Queue(), asyncio.Queue()
        client._queues.update({"s": streamed, "f": final})
        client._held["f"] = []
        for step, reason in enumerate((FinishReason.NONE, FinishReason.NONE, FinishReason.LENGTH)):
            client._dispatch(EngineCoreOutputs([EngineCoreOutput("s", [step]),
                                                EngineCoreOutput("f", [step], finish_reason=reason)]))
            if reason == FinishReason.NONE:
                assert final.empty()
        assert streamed.qsize() == 3 and final.qsize() == 1
        assert (await final.get()).new_token_ids == [0, 1, 2]
        await client._channel.close()

    asyncio.run(run())
