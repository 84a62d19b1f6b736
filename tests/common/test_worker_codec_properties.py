"""Properties of the step stream (services/common/worker_codec.py) over arbitrary sequences of steps:
new, cached and resumed requests, counts, block ids, finished and preempted sets, steady decode
steps (which travel without ids or counts), one or two steps in flight, and steps the worker fails.
What the worker's end decodes is the step the scheduler encoded, step after step, and what the
scheduler's end decodes is the output the worker encoded; a step sent against one the worker failed
is refused with ValueError, never misapplied. A message neither end could have sent (any bytes, any
field values) decodes to complete dataclasses or raises ValueError (StepFailed for a failed step's
answer), the errors the services handle.
"""
from __future__ import annotations

from collections import deque

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common import messages as m
from services.common import worker_codec
from services.common.pb import worker_pb2 as w_pb
from tests.common.message_strategies import (
    INT64, REQUEST_IDS, TEXT, TOKEN_IDS, arbitrary_message, sampling_params, token_logprobs,
)

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None)
BLOCK_IDS = st.lists(st.integers(0, 2**31 - 1), max_size=3)
COUNTS = st.integers(1, 2**16)  # a steady step adds them up: within int32 over a stream


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def _next_num_computed(step: m.SchedulerOutput) -> tuple[list[str], list[int]]:
    """The batch order and each request's count plus what it was scheduled: what a steady step repeats."""
    new, cached = step.scheduled_new_reqs, step.scheduled_cached_reqs
    order = [r.req_id for r in new] + cached.req_ids
    computed = [r.num_computed_tokens for r in new] + cached.num_computed_tokens
    return order, [c + step.num_scheduled_tokens.get(r, 0) for r, c in zip(order, computed)]


def _step(draw, step_id: int, last: m.SchedulerOutput | None) -> m.SchedulerOutput:
    """A steady step after `last` (same requests, order and counts by the rule), or any other."""
    ids = st.lists(REQUEST_IDS, unique=True, max_size=4)
    if last is not None and draw(st.booleans()):
        cached_ids, num_computed = _next_num_computed(last)
        new_reqs, resumed = [], [False] * len(cached_ids)
    else:
        new_ids = draw(ids)
        cached_ids = draw(ids.map(lambda c: [r for r in c if r not in new_ids]))
        new_reqs = [m.NewRequestData(r, draw(TOKEN_IDS), draw(sampling_params()), draw(BLOCK_IDS),
                                     draw(st.integers(0, 2**20)), draw(TEXT)) for r in new_ids]
        num_computed = draw(st.lists(st.integers(0, 2**20), min_size=len(cached_ids), max_size=len(cached_ids)))
        resumed = draw(st.lists(st.booleans(), min_size=len(cached_ids), max_size=len(cached_ids)))
    order = [r.req_id for r in new_reqs] + cached_ids
    scheduled = draw(st.lists(st.sampled_from(order), unique=True)) if order and draw(st.booleans()) else order
    counts = {r: draw(st.just(1) | COUNTS) for r in scheduled}
    num_blocks = st.lists(BLOCK_IDS, min_size=len(cached_ids), max_size=len(cached_ids))
    new_block_ids = draw(num_blocks) if draw(st.booleans()) else [[] for _ in cached_ids]
    return m.SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=m.CachedRequestData(
            req_ids=cached_ids, resumed_from_preemption=resumed, new_block_ids=new_block_ids,
            num_computed_tokens=num_computed,
            resumed_token_ids=[draw(TOKEN_IDS) if r else [] for r in resumed] if any(resumed) else []),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=draw(st.integers(0, 2**31 - 1)),
        finished_req_ids=draw(st.sets(REQUEST_IDS, max_size=2)),
        preempted_req_ids=draw(st.sets(REQUEST_IDS, max_size=2)), step_id=step_id)


def _output(draw, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
    """The worker's answer: the scheduled requests in batch order (as a rule) or a part of them."""
    req_ids = list(step.num_scheduled_tokens)
    if req_ids and draw(st.booleans()):
        req_ids = draw(st.lists(st.sampled_from(req_ids), unique=True))
    n = len(req_ids)
    sampled = draw(st.lists(TOKEN_IDS, min_size=n, max_size=n) | st.just([[7]] * n))
    logprobs = draw(st.lists(st.none() | token_logprobs(), min_size=n, max_size=n))
    failed = draw(st.dictionaries(REQUEST_IDS, TEXT, max_size=2))
    return m.ModelRunnerOutput(req_ids, sampled, logprobs, draw(INT64), draw(INT64), draw(INT64), step.step_id,
                               failed_reqs=failed)


def _run_stream(draw, num_steps: int, max_in_flight: int) -> dict[str, int]:
    """Sends `num_steps` steps through a StepEncoder to a StepDecoder, at most `max_in_flight`
    unanswered (the worker answers each at once; the scheduler reads answers oldest first, when it
    must), each run or failed as drawn; asserts every step and output comes back as it went.
    Returns how many steps went without ids and how many the worker refused."""
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    in_flight: deque[tuple[m.ModelRunnerOutput | None, w_pb.ExecuteModelResponse]] = deque()
    is_last_answer_a_failure = False  # at the worker: the last step it answered failed
    seen = {"elided": 0, "refused": 0}
    last: m.SchedulerOutput | None = None

    def read_answer() -> None:
        output, answer = in_flight.popleft()
        if output is None:
            with pytest.raises(worker_codec.StepFailed):
                encoder.decode_output(answer)
        else:
            assert encoder.decode_output(answer) == output

    for step_id in range(1, num_steps + 1):
        while len(in_flight) >= max_in_flight:
            read_answer()
        last = step = _step(draw, step_id, last)
        msg = _wire(encoder.encode(step))
        seen["elided"] += msg.scheduled_cached_reqs.req_ids_as_last_step
        try:
            decoded = decoder.decode(msg)
        except ValueError:
            # Only a step that refers to one the worker failed, sent before the scheduler knew.
            assert msg.scheduled_cached_reqs.req_ids_as_last_step and is_last_answer_a_failure
            seen["refused"] += 1
            in_flight.append((None, _wire(decoder.encode_failure(step_id, "refused"))))
            continue
        assert decoded == step
        assert list(decoded.num_scheduled_tokens) == [r for r in _next_num_computed(step)[0]
                                                      if r in step.num_scheduled_tokens]  # batch order
        is_last_answer_a_failure = draw(st.booleans())
        if is_last_answer_a_failure:
            in_flight.append((None, _wire(decoder.encode_failure(step_id, "the runner raised"))))
        else:
            output = _output(draw, decoded)
            in_flight.append((output, _wire(decoder.encode_output(output))))
    while in_flight:
        read_answer()
    return seen


@SETTINGS
@given(st.data(), st.integers(1, 8), st.sampled_from([1, 2]))
def test_step_stream_round_trip_with_failures_and_steps_in_flight(data, num_steps, max_in_flight):
    _run_stream(data.draw, num_steps, max_in_flight)


def test_step_streams_reach_the_elided_and_the_refused_cases():
    """The strategy sends steady steps without ids, and steps against failed ones that are refused."""
    total = {"elided": 0, "refused": 0}

    @settings(max_examples=50, deadline=None, derandomize=True, database=None)
    @given(st.data())
    def run(data):
        for key, n in _run_stream(data.draw, 6, 2).items():
            total[key] += n

    run()
    assert total["elided"] >= 20 and total["refused"] >= 3, total


# --- what neither end could have sent -------------------------------------------------------------
def _check_step(step: m.SchedulerOutput) -> None:
    """A decoded step is complete: every per-request column as long as the requests."""
    cached = step.scheduled_cached_reqs
    n = len(cached.req_ids)
    assert len(cached.resumed_from_preemption) == len(cached.new_block_ids) == len(cached.num_computed_tokens) == n
    assert cached.resumed_token_ids == [] or len(cached.resumed_token_ids) == n
    assert set(step.num_scheduled_tokens) <= {r.req_id for r in step.scheduled_new_reqs} | set(cached.req_ids)


def _check_output(output: m.ModelRunnerOutput) -> None:
    assert len(output.req_ids) == len(output.sampled_token_ids) == len(output.logprobs)


def _primed_decoder() -> worker_codec.StepDecoder:
    """A worker's end that ran one step of two requests, so a message may refer to it."""
    encoder, decoder = worker_codec.StepEncoder(), worker_codec.StepDecoder()
    step = m.SchedulerOutput(scheduled_new_reqs=[m.NewRequestData("a", [1, 2], m.SamplingParams(), [1], 0),
                                                 m.NewRequestData("b", [3], m.SamplingParams(), [2], 0)],
                             num_scheduled_tokens={"a": 2, "b": 1}, total_num_scheduled_tokens=3, step_id=1)
    decoder.decode(_wire(encoder.encode(step)))
    decoder.encode_output(m.ModelRunnerOutput(["a", "b"], [[5], [6]], [None, None], step_id=1))
    return decoder


def _decode_step_or_refuse(msg: w_pb.SchedulerOutput, is_primed: bool) -> None:
    decoder = _primed_decoder() if is_primed else worker_codec.StepDecoder()
    try:
        step = decoder.decode(msg)
    except ValueError:
        return
    _check_step(step)


def _decode_output_or_refuse(response: w_pb.ExecuteModelResponse, scheduled: list[str]) -> None:
    encoder = worker_codec.StepEncoder()
    encoder.encode(m.SchedulerOutput(
        scheduled_cached_reqs=m.CachedRequestData(scheduled, [False] * len(scheduled), [[] for _ in scheduled],
                                                  [1] * len(scheduled)),
        num_scheduled_tokens=dict.fromkeys(scheduled, 1), step_id=response.model_runner_output.step_id))
    try:
        output = encoder.decode_output(response)
    except (ValueError, worker_codec.StepFailed):
        return
    _check_output(output)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(arbitrary_message(w_pb.SchedulerOutput), st.booleans())
def test_arbitrary_steps_decode_or_raise_value_error(msg, is_primed):
    _decode_step_or_refuse(_wire(msg), is_primed)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(arbitrary_message(w_pb.ExecuteModelResponse), st.lists(REQUEST_IDS, unique=True, max_size=3))
def test_arbitrary_answers_decode_or_raise_value_error(response, scheduled):
    _decode_output_or_refuse(_wire(response), scheduled)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=200), st.booleans(), st.lists(REQUEST_IDS, unique=True, max_size=3))
def test_arbitrary_bytes_parse_and_decode_or_raise_documented_errors(raw, is_primed, scheduled):
    try:
        request = w_pb.ExecuteModelRequest.FromString(raw)
    except DecodeError:
        pass
    else:
        _decode_step_or_refuse(request.scheduler_output, is_primed)
    try:
        response = w_pb.ExecuteModelResponse.FromString(raw)
    except DecodeError:
        return
    _decode_output_or_refuse(response, scheduled)
