"""SchedulerOutput and ModelRunnerOutput travel in columns: every shape must come back as it went."""
from __future__ import annotations

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
