"""SchedulerOutput and ModelRunnerOutput travel in columns: every shape must come back as it went,
and what one end of the step stream leaves out the other end fills in to the complete dataclass."""
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


def _answer(decoder, s):
    """What the worker does with a step that ran: answers it, so the next step may refer to it."""
    req_ids = list(s.num_scheduled_tokens)
    return decoder.encode_output(m.ModelRunnerOutput(req_ids, [[9]] * len(req_ids), [None] * len(req_ids),
                                                     step_id=s.step_id))


def _through_stream(steps):
    """Sends `steps` from a scheduler's end to a worker's end, each answered before the next goes;
    returns each step's message and what the worker decoded."""
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    messages, decoded = [], []
    for s in steps:
        messages.append(_wire(encoder.encode(s)))
        decoded.append(decoder.decode(messages[-1]))
        assert encoder.decode_output(_wire(_answer(decoder, decoded[-1]))).step_id == s.step_id
    return messages, decoded


def test_a_step_with_the_last_steps_requests_sends_no_ids_and_decodes_to_them():
    admit = m.SchedulerOutput(
        scheduled_new_reqs=[m.NewRequestData("a", [1, 2], m.SamplingParams(), [4], 0),
                            m.NewRequestData("b", [3], m.SamplingParams(), [5], 0)],
        num_scheduled_tokens={"a": 2, "b": 1}, total_num_scheduled_tokens=3, step_id=1)
    steps = [admit,
             _decode_step(["a", "b"], [2, 1], [[], [6]], step_id=2),  # same requests and order as the admission
             _decode_step(["b", "a"], [2, 3], step_id=3),             # reordered: ids sent
             _decode_step(["b"], [3], step_id=4)]                     # one left: ids sent
    messages, back = _through_stream(steps)
    assert [msg.scheduled_cached_reqs.req_ids_as_last_step for msg in messages] == [False, True, False, False]
    elided = messages[1].scheduled_cached_reqs
    assert not elided.req_ids and not elided.num_computed_tokens and list(elided.new_block_ids) == [6]
    # Every step comes back complete, the elided one too: ids, blocks, the scheduler's counts, batch order.
    assert back == steps
    assert back[1].scheduled_cached_reqs.num_computed_tokens == [2, 1]
    assert list(back[1].num_scheduled_tokens) == ["a", "b"]


def test_a_steady_step_decodes_with_each_count_the_last_plus_what_it_was_scheduled():
    admit = m.SchedulerOutput(  # a prefix hit (a starts at 4) and a chunk (b gets 3 of its 8 tokens)
        scheduled_new_reqs=[m.NewRequestData("a", [1] * 6, m.SamplingParams(), [4, 5], 4),
                            m.NewRequestData("b", [2] * 8, m.SamplingParams(), [6, 7], 0)],
        num_scheduled_tokens={"a": 2, "b": 3}, total_num_scheduled_tokens=5, step_id=1)
    chunk = _decode_step(["a", "b"], [6, 3], step_id=2)
    chunk.num_scheduled_tokens = {"a": 1, "b": 5}  # b's last chunk
    steady = _decode_step(["a", "b"], [7, 8], [[8], []], step_id=3)
    messages, back = _through_stream([admit, chunk, steady])
    assert [msg.scheduled_cached_reqs.req_ids_as_last_step for msg in messages] == [False, True, True]
    assert not messages[2].scheduled_cached_reqs.num_computed_tokens
    assert [b.scheduled_cached_reqs.num_computed_tokens for b in back[1:]] == [[6, 3], [7, 8]]
    assert back == [admit, chunk, steady]


def test_a_step_whose_counts_do_not_follow_the_rule_is_sent_in_full():
    first = _decode_step(["a", "b"], [5, 9], step_id=1)
    # Same requests and order, but b's count is not 9 + 1 (as after a count the worker could not know).
    second = _decode_step(["a", "b"], [6, 4], step_id=2)
    messages, back = _through_stream([first, second])
    cached = messages[1].scheduled_cached_reqs
    assert not cached.req_ids_as_last_step
    assert list(cached.req_ids) == ["a", "b"] and list(cached.num_computed_tokens) == [6, 4]
    assert back == [first, second]


def test_the_stream_check_catches_an_encoder_that_elides_counts_off_the_rule(monkeypatch):
    """An encoder that compared only the order would have the worker fill in counts the scheduler did
    not send: comparing the decoded steps with the scheduler's, as the tests above do, catches it."""
    class EqualToAnything(list):
        def __eq__(self, other):
            return True

    original = worker_codec._encode_step

    def order_only(s, last):
        if last is not None:
            last = worker_codec._LastStep(last.order, EqualToAnything(last.next_num_computed))
        return original(s, last)

    monkeypatch.setattr(worker_codec, "_encode_step", order_only)
    steps = [_decode_step(["a", "b"], [5, 9], step_id=1), _decode_step(["a", "b"], [6, 4], step_id=2)]
    messages, back = _through_stream(steps)
    assert messages[1].scheduled_cached_reqs.req_ids_as_last_step  # the broken encoder elided it
    assert back[1].scheduled_cached_reqs.num_computed_tokens == [6, 10]  # not the scheduler's [6, 4]
    with pytest.raises(AssertionError):
        assert back == steps


def test_resumed_requests_and_new_streams_are_never_sent_as_the_last_step():
    encoder = worker_codec.StepEncoder()
    first = encoder.encode(_decode_step(["a"], [4]))
    assert not first.scheduled_cached_reqs.req_ids_as_last_step  # nothing before it on this stream
    resumed = _decode_step(["a"], [0])
    resumed.scheduled_cached_reqs.resumed_from_preemption = [True]
    resumed.scheduled_cached_reqs.resumed_token_ids = [[1, 2, 3]]
    assert not encoder.encode(resumed).scheduled_cached_reqs.req_ids_as_last_step
    # A decoder that saw no step before cannot resolve a reference to one.
    elided = encoder.encode(_decode_step(["a"], [1]))
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


def test_outputs_of_steps_in_flight_decode_with_their_own_steps_ids():
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    first = _decode_step(["a", "b"], [3, 4], step_id=1)
    second = _decode_step(["a"], [4], step_id=2)  # b is not scheduled: a different step's ids
    second.finished_req_ids = {"b"}
    answers = []
    for s in (first, second):  # both sent before either answer is read, as with async scheduling
        msg = _wire(encoder.encode(s))
        answers.append(_wire(_answer(decoder, decoder.decode(msg))))
    assert all(a.model_runner_output.req_ids_as_scheduled and not a.model_runner_output.req_ids for a in answers)
    outputs = [encoder.decode_output(a) for a in answers]
    assert [(o.req_ids, o.sampled_token_ids, o.step_id) for o in outputs] == \
        [(["a", "b"], [[9], [9]], 1), (["a"], [[9]], 2)]


def test_an_output_decodes_with_the_batch_order_whatever_the_dicts_order():
    so = m.SchedulerOutput(
        scheduled_cached_reqs=m.CachedRequestData(req_ids=["a", "b", "c"], resumed_from_preemption=[False] * 3,
                                                  new_block_ids=[[], [], []], num_computed_tokens=[3, 4, 5]),
        num_scheduled_tokens={"c": 2, "a": 1}, total_num_scheduled_tokens=3)  # not in batch order; b gets none
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    decoded = decoder.decode(_wire(encoder.encode(so)))
    assert list(decoded.num_scheduled_tokens) == ["a", "c"]
    answer = _wire(decoder.encode_output(m.ModelRunnerOutput(["a", "c"], [[1], [2]], [None, None])))
    assert answer.model_runner_output.req_ids_as_scheduled
    assert encoder.decode_output(answer).req_ids == ["a", "c"]  # a's token is a's, c's is c's


def _ok(step_id, req_ids):
    return worker_pb2.ExecuteModelResponse(model_runner_output=worker_codec.model_runner_output_to_pb(
        m.ModelRunnerOutput(req_ids, [[9]] * len(req_ids), [None] * len(req_ids), step_id=step_id), req_ids))


def test_an_answer_must_be_for_the_oldest_step_in_flight():
    encoder = worker_codec.StepEncoder()
    encoder.encode(_decode_step(["a"], [4], step_id=1))
    encoder.encode(_decode_step(["a"], [5], step_id=2))
    with pytest.raises(ValueError, match="step 2 where step 1 was due"):
        encoder.decode_output(_wire(_ok(2, ["a"])))
    with pytest.raises(ValueError, match="no step is in flight"):
        worker_codec.StepEncoder().decode_output(_wire(_ok(1, ["a"])))


def test_a_step_that_fails_to_decode_leaves_nothing_for_the_next_to_refer_to(monkeypatch):
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    _answer(decoder, decoder.decode(_wire(encoder.encode(_decode_step(["a"], [4])))))
    lost = _wire(encoder.encode(_decode_step(["a"], [5])))
    assert lost.scheduled_cached_reqs.req_ids_as_last_step
    with monkeypatch.context() as patch:
        patch.setattr(worker_codec, "_decode_step", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(RuntimeError):
            decoder.decode(lost)
    decoder.encode_failure(0, "x")  # the worker answers the step it could not decode
    with pytest.raises(ValueError, match="last step"):  # sent against the lost step: refused, not misapplied
        decoder.decode(_wire(encoder.encode(_decode_step(["a"], [6]))))


def test_a_step_that_fails_to_run_leaves_nothing_to_refer_to_and_the_next_step_goes_in_full():
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    answers = [_answer(decoder, decoder.decode(_wire(encoder.encode(_decode_step(["a"], [4], step_id=1)))))]
    decoder.decode(_wire(encoder.encode(_decode_step(["a"], [5], step_id=2))))
    answers.append(decoder.encode_failure(2, "the runner raised"))
    referring = _wire(encoder.encode(_decode_step(["a"], [6], step_id=3)))  # sent before step 2's answer is read
    assert referring.scheduled_cached_reqs.req_ids_as_last_step
    with pytest.raises(ValueError, match="last step"):  # refused, not run on what the failed step left
        decoder.decode(referring)
    answers.append(decoder.encode_failure(3, "refused"))
    assert encoder.decode_output(_wire(answers[0])).req_ids == ["a"]
    for answer, message in zip(answers[1:], ["the runner raised", "refused"]):
        with pytest.raises(worker_codec.StepFailed, match=message):
            encoder.decode_output(_wire(answer))
    # Told of the failure, the scheduler's end sends its next step in full; the one after refers to it.
    step4, step5 = _decode_step(["a"], [5], step_id=4), _decode_step(["a"], [6], step_id=5)
    full = _wire(encoder.encode(step4))
    assert not full.scheduled_cached_reqs.req_ids_as_last_step and decoder.decode(full) == step4
    _answer(decoder, step4)
    elided = _wire(encoder.encode(step5))
    assert elided.scheduled_cached_reqs.req_ids_as_last_step and decoder.decode(elided) == step5


def test_constraints_and_grammar_compiles_cross_the_step_stream():
    from services.common.structured_outputs import StructuredOutputsParams

    regex = StructuredOutputsParams("regex", "[a-z]+")
    schema = StructuredOutputsParams("json", '{"type": "object"}', any_whitespace=True)
    so = m.SchedulerOutput(
        scheduled_new_reqs=[m.NewRequestData("n1", [1, 2], m.SamplingParams(structured_outputs=schema), [4], 0)],
        num_scheduled_tokens={"n1": 2}, total_num_scheduled_tokens=2, step_id=1,
        grammars_to_compile={regex.key: regex, schema.key: schema})
    back = worker_codec.scheduler_output_from_pb(_wire(worker_codec.scheduler_output_to_pb(so)))
    assert back == so
    assert back.scheduled_new_reqs[0].sampling_params.structured_outputs == schema
    out = m.ModelRunnerOutput(req_ids=["n1"], sampled_token_ids=[[3]], logprobs=[None], step_id=1,
                              compiled_grammar_keys=[regex.key], failed_grammars={schema.key: "bad schema"})
    assert worker_codec.model_runner_output_from_pb(_wire(worker_codec.model_runner_output_to_pb(out))) == out
    plain = m.SchedulerOutput(scheduled_new_reqs=[m.NewRequestData("n2", [1], m.SamplingParams(), [4], 0)],
                              num_scheduled_tokens={"n2": 1}, total_num_scheduled_tokens=1)
    msg = worker_codec.scheduler_output_to_pb(plain)
    assert not msg.grammars_to_compile and not msg.scheduled_new_reqs[0].sampling_params.HasField("structured_outputs")
    assert worker_codec.scheduler_output_from_pb(_wire(msg)).scheduled_new_reqs[0].sampling_params.structured_outputs is None
