"""EngineCoreOutputs travel in columns: every shape must come back as it went."""
from __future__ import annotations

import pytest

from services.common import codec
from services.common import messages as m
from services.common.pb import engine_core_pb2
from tests.step_outputs import outputs_from, per_request


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_engine_core_outputs_plain_in_columns_the_rest_in_full():
    out = m.EngineCoreOutput
    full = [
        out("c", [4], finish_reason=m.FinishReason.LENGTH, num_cached_tokens=3),
        out("d", [], events=[m.RequestEvent(m.RequestEventType.QUEUED, 1.5)]),
        out("e", [5], finish_reason=m.FinishReason.STOP, stop_reason=7),
        out("f", [6], new_logprobs=[m.TokenLogprobs(-0.25, 1)]),
        out("g", [], finish_reason=m.FinishReason.ERROR, error_message="boom", error_code="internal"),
    ]
    for plain_token_ids in ([[1], [2]], [[1], [2, 3]]):  # one token each (no counts sent) or not
        plain = [out("a", plain_token_ids[0]), out("b", plain_token_ids[1])]
        eco = outputs_from(full + plain, m.SchedulerStats(num_running_reqs=2, num_steps=3), 12.5)
        assert list(eco.extras) == ["c", "d", "e", "f", "g"]
        msg, plain_req_ids = codec.engine_core_outputs_to_pb(eco)
        msg = _wire(msg)
        assert isinstance(msg, engine_core_pb2.EngineCoreOutputs)
        assert list(msg.request_ids) == plain_req_ids == ["a", "b"] and len(msg.outputs) == 5
        assert len(msg.num_new_token_ids) == (0 if plain_token_ids == [[1], [2]] else 2)
        back, _ = codec.engine_core_outputs_from_pb(msg)
        assert back == eco
        assert per_request(back) == full + plain
    assert back.scheduler_stats == eco.scheduler_stats and back.timestamp == 12.5


def test_plain_outputs_for_the_last_messages_requests_send_no_ids():
    steps = [m.EngineCoreOutputs(["a", "b"], [[1], [2]]),
             m.EngineCoreOutputs(["a", "b"], [[3], [4]]),   # same: ids left out
             outputs_from([m.EngineCoreOutput("a", [], finish_reason=m.FinishReason.ABORT)]),  # no plain
             m.EngineCoreOutputs(["a", "b"], [[5], [6]]),   # still as the last plain
             m.EngineCoreOutputs(["b"], [[7]])]             # changed: ids sent
    encoder, decoder = codec.OutputsEncoder(), codec.OutputsDecoder()
    flags = []
    for eco in steps:
        msg = _wire(encoder.encode(eco))
        flags.append(msg.request_ids_as_last)
        assert not (msg.request_ids_as_last and msg.request_ids)
        assert decoder.decode(msg) == eco
    assert flags == [False, True, False, True, False]
    with pytest.raises(ValueError, match="last message"):
        codec.engine_core_outputs_from_pb(codec.engine_core_outputs_to_pb(steps[1], ["a", "b"])[0])
