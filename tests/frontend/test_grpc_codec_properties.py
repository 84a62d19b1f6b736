"""Properties of the public gRPC API's codec (services/frontend/grpc_codec.py): a request in the
documented ranges decodes to exactly its values; any request at all (any field values, any bytes)
decodes or is refused with an APIError 400 naming a field, the codec's one error, which the
servicer turns into INVALID_ARGUMENT; a response carries its delta field for field.
"""
from __future__ import annotations

from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common import messages as m
from services.common.pb import generate_pb2 as pb
from services.frontend import grpc_codec
from services.frontend.errors import APIError
from services.frontend.protocol import MAX_LOGPROBS, MAX_N
from services.frontend.serving_engine import TextDelta
from tests.common.message_strategies import INT32, INT64, TEXT, TOKEN_IDS, arbitrary_message, token_logprobs

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def _f32(low: float, high: float, exclude_min: bool = False) -> st.SearchStrategy[float]:
    return st.floats(low, high, width=32, exclude_min=exclude_min)


@st.composite
def valid_params(draw) -> m.SamplingParams:
    """Sampling params inside every documented range (max_tokens 0: as many as fit)."""
    return m.SamplingParams(
        n=draw(st.integers(1, MAX_N)), temperature=draw(_f32(0, 2)), top_p=draw(_f32(0, 1, exclude_min=True)),
        top_k=draw(st.integers(0, 2**31 - 1)), min_p=draw(_f32(0, 1)), seed=draw(st.none() | INT64),
        presence_penalty=draw(_f32(-2, 2)), frequency_penalty=draw(_f32(-2, 2)),
        repetition_penalty=draw(_f32(0, 2.0**20, exclude_min=True)),
        logit_bias=draw(st.dictionaries(st.integers(0, 2**31 - 1), _f32(-100, 100), max_size=3)),
        max_tokens=draw(st.integers(0, 2**31 - 1)), min_tokens=draw(st.integers(0, 2**31 - 1)),
        stop_token_ids=tuple(draw(TOKEN_IDS)), ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, MAX_LOGPROBS)), prompt_logprobs=None)


def _params_pb(p: m.SamplingParams) -> pb.GenerateRequest.SamplingParams:
    msg = pb.GenerateRequest.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, max_tokens=p.max_tokens,
        min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


@SETTINGS
@given(params=valid_params(), prompt=st.text(min_size=1) | st.lists(st.integers(0, 2**31 - 1), max_size=6),
       stop=st.lists(st.text(min_size=1, max_size=4), max_size=3), priority=INT32, model=TEXT,
       include_stop_str=st.booleans())
def test_requests_in_range_decode_to_their_values(params, prompt, stop, priority, model, include_stop_str):
    msg = pb.GenerateRequest(sampling_params=_params_pb(params), stop=stop, priority=priority, model=model,
                             include_stop_str_in_output=include_stop_str)
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.token_ids.extend(prompt)
    request = grpc_codec.generate_request_from_pb(_wire(msg))
    assert request.prompt == prompt
    options = request.options
    assert options.sampling_params == params
    assert options.max_tokens == (params.max_tokens or None)
    assert (options.stop, options.priority, options.model) == (tuple(stop), priority, model or None)
    assert options.include_stop_str_in_output == include_stop_str


def _decode_or_refuse(msg: pb.GenerateRequest) -> None:
    try:
        request = grpc_codec.generate_request_from_pb(msg)
    except APIError as err:
        assert err.status == 400 and err.param, (err.status, err.param, err.message)
        return
    # An empty token list passes here: the serving layer refuses it with every empty prompt.
    assert request.prompt != "" and isinstance(request.options.sampling_params, m.SamplingParams)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(arbitrary_message(pb.GenerateRequest))
def test_any_request_decodes_or_is_refused_naming_a_field(msg):
    _decode_or_refuse(_wire(msg))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=200))
def test_any_bytes_parse_and_decode_or_raise_documented_errors(raw):
    try:
        msg = pb.GenerateRequest.FromString(raw)
    except DecodeError:
        return
    _decode_or_refuse(msg)


@SETTINGS
@given(request_id=TEXT, index=st.integers(0, 2**31 - 1), text=st.text(),
       token_ids=TOKEN_IDS, finish_reason=st.sampled_from([None, "stop", "length"]),
       counts=st.tuples(*[st.integers(0, 2**31 - 1)] * 3), logprobs=st.lists(token_logprobs(), max_size=3))
def test_responses_carry_their_delta(request_id, index, text, token_ids, finish_reason, counts, logprobs):
    num_prompt, num_completion, num_cached = counts
    delta = TextDelta(text, token_ids, finish_reason, num_cached, logprobs)
    msg = _wire(grpc_codec.generate_response_to_pb(request_id, index, delta, num_prompt, num_completion))
    assert (msg.request_id, msg.index, msg.text, list(msg.token_ids)) == (request_id, index, text, token_ids)
    assert (msg.num_prompt_tokens, msg.num_completion_tokens, msg.num_cached_tokens) == counts
    assert pb.GenerateResponse.FinishReason.Name(msg.finish_reason) == \
        f"FINISH_REASON_{(finish_reason or 'unspecified').upper()}"
    assert [(lp.logprob, lp.rank, [(t.token_id, t.logprob) for t in lp.top_logprobs]) for lp in msg.logprobs] == \
        [(lp.logprob, lp.rank, lp.top_logprobs) for lp in logprobs]
