"""Properties of the frontend <-> scheduler codec (services/common/codec.py): whatever the
dataclasses hold comes back through the wire as it went, over any sequence of step outputs on one
stream; and a message the other end could not have sent (any bytes, any field values) is decoded
to complete dataclasses or refused with ValueError, the codec's one error type, which the services
treat as a broken stream.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from google.protobuf.message import DecodeError

from services.common import codec
from services.common import messages as m
from services.common.pb import engine_core_pb2 as ec_pb
from tests.common.message_strategies import (
    DOUBLE, REQUEST_IDS, TOKEN_IDS, arbitrary_message, engine_core_requests, output_extras, sampling_params,
    scheduler_stats,
)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


@SETTINGS
@given(sampling_params())
def test_sampling_params_round_trip(params):
    assert codec.sampling_params_from_pb(_wire(codec.sampling_params_to_pb(params))) == params


@SETTINGS
@given(engine_core_requests())
def test_engine_core_request_round_trip(request):
    assert codec.engine_core_request_from_pb(_wire(codec.engine_core_request_to_pb(request))) == request


@st.composite
def outputs_streams(draw) -> list[m.EngineCoreOutputs]:
    """Steps of one stream; a step often has the same plain requests as the one before (the case
    whose ids the encoder leaves out), often not, with extras for a few."""
    steps, req_ids = [], draw(st.lists(REQUEST_IDS, unique=True, max_size=5))
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            req_ids = draw(st.lists(REQUEST_IDS, unique=True, max_size=5))
        new_token_ids = [draw(TOKEN_IDS if draw(st.booleans()) else st.lists(TOKEN_IDS, min_size=1, max_size=1)
                              .map(lambda ids: ids[0][:1] or [7])) for _ in req_ids]
        with_extras = draw(st.sets(st.sampled_from(req_ids))) if req_ids and draw(st.booleans()) else set()
        extras = {r: draw(output_extras()) for r in req_ids if r in with_extras}
        steps.append(m.EngineCoreOutputs(list(req_ids), new_token_ids, extras,
                                         draw(st.none() | scheduler_stats()), draw(DOUBLE)))
    return steps


def _extras_first(outputs: m.EngineCoreOutputs) -> m.EngineCoreOutputs:
    """The order the decoder hands outputs over: those with extras first, each part in step order."""
    order = [i for i, r in enumerate(outputs.req_ids) if r in outputs.extras] + \
        [i for i, r in enumerate(outputs.req_ids) if r not in outputs.extras]
    return m.EngineCoreOutputs([outputs.req_ids[i] for i in order], [outputs.new_token_ids[i] for i in order],
                               outputs.extras, outputs.scheduler_stats, outputs.timestamp)


@SETTINGS
@given(outputs_streams())
def test_outputs_round_trip_step_after_step(steps):
    encoder, decoder = codec.OutputsEncoder(), codec.OutputsDecoder()
    num_elided = 0
    for outputs in steps:
        msg = _wire(encoder.encode(outputs))
        num_elided += msg.request_ids_as_last
        back = decoder.decode(msg)
        assert back == _extras_first(outputs)
        assert list(back.extras) == [r for r in back.req_ids if r in outputs.extras]


def test_outputs_streams_do_leave_ids_out():
    """The stream strategy reaches the elided case, so the round trip above covers it."""
    seen = []

    @settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @given(outputs_streams())
    def run(steps):
        encoder = codec.OutputsEncoder()
        seen.extend(encoder.encode(s).request_ids_as_last for s in steps)

    run()
    assert any(seen) and not all(seen)


# --- what the other end could not have sent ------------------------------------------------------
def _check_outputs(outputs: m.EngineCoreOutputs) -> None:
    """A decoded step is complete: one token list per request, extras only for its requests."""
    assert len(outputs.req_ids) == len(outputs.new_token_ids)
    assert set(outputs.extras) <= set(outputs.req_ids)
    assert all(isinstance(ids, list) for ids in outputs.new_token_ids)


def _decode_outputs_or_refuse(msg: ec_pb.EngineCoreOutputs, last_plain_req_ids: list[str] | None) -> None:
    decoder = codec.OutputsDecoder()
    decoder.last_plain_req_ids = last_plain_req_ids
    try:
        outputs = decoder.decode(msg)
    except ValueError:
        return
    _check_outputs(outputs)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(arbitrary_message(ec_pb.EngineCoreOutputs), st.none() | st.lists(REQUEST_IDS, max_size=3))
def test_arbitrary_outputs_messages_decode_or_raise_value_error(msg, last_plain_req_ids):
    _decode_outputs_or_refuse(_wire(msg), last_plain_req_ids)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=200), st.none() | st.lists(REQUEST_IDS, max_size=3))
def test_arbitrary_bytes_parse_and_decode_or_raise_documented_errors(raw, last_plain_req_ids):
    for cls in (ec_pb.EngineCoreOutputs, ec_pb.ConnectResponse):
        try:
            msg = cls.FromString(raw)
        except DecodeError:
            continue
        _decode_outputs_or_refuse(msg if cls is ec_pb.EngineCoreOutputs else msg.outputs, last_plain_req_ids)
    try:
        request = ec_pb.ConnectRequest.FromString(raw)
    except DecodeError:
        return
    if request.WhichOneof("kind") == "add_request":
        decoded = codec.engine_core_request_from_pb(request.add_request)  # nothing in it to refuse
        assert isinstance(decoded.sampling_params, m.SamplingParams)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(arbitrary_message(ec_pb.EngineCoreRequest))
def test_arbitrary_requests_decode(msg):
    """Every field value is representable: decoding never fails (the scheduler checks ranges)."""
    request = codec.engine_core_request_from_pb(_wire(msg))
    assert len(request.prompt_token_ids) == len(msg.prompt_token_ids)
