"""SchedulerOutput and ModelRunnerOutput travel in columns: every shape must come back as it went."""
from __future__ import annotations

import pytest

from services.common import messages as m
from services.common import worker_codec
from services.common.pb import worker_pb2


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_scheduler_output_round_trip_keeps_batch_order_and_resumed_tokens():
    so = m.SchedulerOutput(
        scheduled_new_reqs=[m.NewRequestData("n1", [1, 2, 3], m.SamplingParams(), [4, 5], 0, "tp")],
        scheduled_cached_reqs=m.CachedRequestData(
            req_ids=["a", "b", "c"], resumed_from_preemption=[False, True, False],
            new_block_ids=[[], [7, 8], [9]], num_computed_tokens=[5, 0, 7], resumed_token_ids=[[], [1, 2, 3, 4], []]),
        num_scheduled_tokens={"n1": 3, "a": 1, "b": 4, "c": 1}, total_num_scheduled_tokens=9,
        finished_req_ids={"z"}, preempted_req_ids={"y"}, step_id=3)
    back = worker_codec.scheduler_output_from_pb(_wire(worker_codec.scheduler_output_to_pb(so)))
    assert back == so
    assert list(back.num_scheduled_tokens) == ["n1", "a", "b", "c"]


def test_decode_step_without_new_blocks_sends_no_per_request_counts_or_flags():
    so = m.SchedulerOutput(
        scheduled_cached_reqs=m.CachedRequestData(req_ids=["a", "b"], resumed_from_preemption=[False, False],
                                                  new_block_ids=[[], []], num_computed_tokens=[3, 4]),
        num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2)
    msg = worker_codec.scheduler_output_to_pb(so)
    cached = msg.scheduled_cached_reqs
    assert not cached.num_new_block_ids and not cached.resumed_token_ids
    assert not cached.resumed_from_preemption and not msg.num_scheduled_tokens  # one token each, none resumed
    back = worker_codec.scheduler_output_from_pb(_wire(msg))
    assert back == so and list(back.num_scheduled_tokens) == ["a", "b"]


def test_counts_are_sent_when_any_request_gets_other_than_one_token():
    so = m.SchedulerOutput(
        scheduled_cached_reqs=m.CachedRequestData(req_ids=["a", "b"], resumed_from_preemption=[False, False],
                                                  new_block_ids=[[], []], num_computed_tokens=[3, 4]),
        num_scheduled_tokens={"b": 5, "a": 1}, total_num_scheduled_tokens=6)  # not in batch order
    msg = worker_codec.scheduler_output_to_pb(so)
    assert list(msg.num_scheduled_tokens) == [1, 5]  # batch order: the cached requests' order
    assert worker_codec.scheduler_output_from_pb(_wire(msg)).num_scheduled_tokens == {"a": 1, "b": 5}


def test_model_runner_output_round_trip():
    lp = m.TokenLogprobs(-0.5, 1, [(1, -0.5), (2, -1.0)])
    for ro in [m.ModelRunnerOutput(["a", "b"], [[1], [2]], [None, None], 1, 2, 3, 4),
               m.ModelRunnerOutput(["a", "b", "c"], [[1], [], [5, 6]], [None, lp, None], 1, 2, 3, 4),
               m.ModelRunnerOutput(["a"], [[]], [None]),
               m.ModelRunnerOutput()]:
        msg = _wire(worker_codec.model_runner_output_to_pb(ro))
        assert isinstance(msg, worker_pb2.ModelRunnerOutput)
        assert worker_codec.model_runner_output_from_pb(msg) == ro


def _decode_step(req_ids, num_computed, new_block_ids=None, step_id=0):
    n = len(req_ids)
    return m.SchedulerOutput(
        scheduled_cached_reqs=m.CachedRequestData(req_ids=list(req_ids), resumed_from_preemption=[False] * n,
                                                  new_block_ids=new_block_ids or [[] for _ in req_ids],
                                                  num_computed_tokens=list(num_computed)),
        num_scheduled_tokens=dict.fromkeys(req_ids, 1), total_num_scheduled_tokens=n, step_id=step_id)


def test_a_step_with_the_last_steps_requests_sends_no_ids_and_decodes_to_them():
    admit = m.SchedulerOutput(
        scheduled_new_reqs=[m.NewRequestData("a", [1, 2], m.SamplingParams(), [4], 0),
                            m.NewRequestData("b", [3], m.SamplingParams(), [5], 0)],
        num_scheduled_tokens={"a": 2, "b": 1}, total_num_scheduled_tokens=3, step_id=1)
    steps = [admit,
             _decode_step(["a", "b"], [2, 1], [[], [6]], step_id=2),  # same requests and order as the admission
             _decode_step(["b", "a"], [2, 3], step_id=3),             # reordered: ids sent
             _decode_step(["b"], [3], step_id=4)]                     # one left: ids sent
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    messages = [_wire(encoder.encode(s)) for s in steps]
    assert [msg.scheduled_cached_reqs.req_ids_as_last_step for msg in messages] == [False, True, False, False]
    elided = messages[1].scheduled_cached_reqs
    assert not elided.req_ids and not elided.num_computed_tokens and list(elided.new_block_ids) == [6]
    back = [decoder.decode(msg) for msg in messages]
    assert back[0] == admit and back[2] == steps[2] and back[3] == steps[3]
    # The elided step comes back with the ids, blocks and batch order; the counts are the worker's own.
    assert back[1].scheduled_cached_reqs.req_ids == ["a", "b"]
    assert back[1].scheduled_cached_reqs.new_block_ids == [[], [6]]
    assert back[1].scheduled_cached_reqs.num_computed_tokens == []
    assert list(back[1].num_scheduled_tokens) == ["a", "b"]


def test_resumed_requests_and_new_streams_are_never_sent_as_the_last_step():
    encoder = worker_codec.StepEncoder()
    first = encoder.encode(_decode_step(["a"], [4]))
    assert not first.scheduled_cached_reqs.req_ids_as_last_step  # nothing before it on this stream
    resumed = _decode_step(["a"], [0])
    resumed.scheduled_cached_reqs.resumed_from_preemption = [True]
    resumed.scheduled_cached_reqs.resumed_token_ids = [[1, 2, 3]]
    assert not encoder.encode(resumed).scheduled_cached_reqs.req_ids_as_last_step
    # A decoder that saw no step before cannot resolve a reference to one.
    elided = encoder.encode(_decode_step(["a"], [3]))
    assert elided.scheduled_cached_reqs.req_ids_as_last_step
    with pytest.raises(ValueError, match="last step"):
        worker_codec.StepDecoder().decode(_wire(elided))


def test_model_runner_output_for_the_scheduled_requests_sends_no_ids():
    ro = m.ModelRunnerOutput(["a", "b"], [[1], [2]], [None, None], step_id=7)
    msg = _wire(worker_codec.model_runner_output_to_pb(ro, ["a", "b"]))
    assert msg.req_ids_as_scheduled and not msg.req_ids
    assert worker_codec.model_runner_output_from_pb(msg, ["a", "b"]) == ro
    partial = m.ModelRunnerOutput(["b"], [[2]], [None])  # not the scheduled set: ids sent
    msg = _wire(worker_codec.model_runner_output_to_pb(partial, ["a", "b"]))
    assert not msg.req_ids_as_scheduled and list(msg.req_ids) == ["b"]
    assert worker_codec.model_runner_output_from_pb(msg, ["a", "b"]) == partial
    empty = m.ModelRunnerOutput(step_id=8)  # a step that only carried finished ids
    assert worker_codec.model_runner_output_from_pb(_wire(worker_codec.model_runner_output_to_pb(empty, [])), []) == empty


def test_a_step_that_fails_to_decode_leaves_nothing_for_the_next_to_refer_to(monkeypatch):
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    decoder.decode(_wire(encoder.encode(_decode_step(["a"], [4]))))
    lost = _wire(encoder.encode(_decode_step(["a"], [5])))
    with monkeypatch.context() as patch:
        patch.setattr(worker_codec, "scheduler_output_from_pb", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(RuntimeError):
            decoder.decode(lost)
    with pytest.raises(ValueError, match="last step"):  # sent against the lost step: refused, not misapplied
        decoder.decode(_wire(encoder.encode(_decode_step(["a"], [6]))))
