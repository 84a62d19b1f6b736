"""Hypothesis strategies for the services' messages: dataclasses in the domain the codecs promise to
carry exactly, and arbitrary protobuf messages (any value in any field) for the decoders to refuse.

Floats are float32 where the proto field is a `float`; counts and ids are within int32 where the
field is one. Proto3 zero values that a codec reads as "unset" (n, top_p, repetition_penalty 0;
logprob rank 0) are outside the domain: the frontend never sends them.
"""
from __future__ import annotations

from typing import Any

from google.protobuf import descriptor
from hypothesis import strategies as st

from services.common import messages as m

INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
# Mostly small, so that counts and indices in arbitrary messages are sometimes nearly right.
SMALL_OR_INT32 = st.integers(-2, 6) | INT32
TOKEN_IDS = st.lists(st.integers(0, 2**31 - 1), max_size=6)
FLOAT32 = st.floats(width=32, allow_nan=False)
DOUBLE = st.floats(allow_nan=False)
TEXT = st.text(max_size=12)  # never a lone surrogate: protobuf strings are UTF-8
REQUEST_IDS = st.text(st.characters(codec="ascii"), min_size=1, max_size=6)


def sampling_params() -> st.SearchStrategy[m.SamplingParams]:
    positive = st.floats(width=32, min_value=0, exclude_min=True, allow_nan=False)
    return st.builds(
        m.SamplingParams,
        n=st.integers(1, 2**31 - 1), temperature=FLOAT32, top_p=positive, top_k=INT32, min_p=FLOAT32,
        seed=st.none() | INT64, presence_penalty=FLOAT32, frequency_penalty=FLOAT32, repetition_penalty=positive,
        logit_bias=st.dictionaries(INT32, FLOAT32, max_size=3), max_tokens=INT32, min_tokens=INT32,
        stop_token_ids=st.lists(INT32, max_size=3).map(tuple), ignore_eos=st.booleans(),
        logprobs=st.none() | INT32, prompt_logprobs=st.none() | INT32)


def engine_core_requests() -> st.SearchStrategy[m.EngineCoreRequest]:
    return st.builds(m.EngineCoreRequest, request_id=TEXT, prompt_token_ids=TOKEN_IDS,
                     sampling_params=sampling_params(), arrival_time=DOUBLE, priority=INT32,
                     eos_token_ids=st.lists(INT32, max_size=3).map(tuple), cache_salt=TEXT, traceparent=TEXT,
                     tracestate=TEXT)


def token_logprobs() -> st.SearchStrategy[m.TokenLogprobs]:
    top = st.lists(st.tuples(INT32, FLOAT32), max_size=3)
    return st.builds(m.TokenLogprobs, logprob=FLOAT32, rank=st.integers(1, 2**31 - 1), top_logprobs=top)


def output_extras() -> st.SearchStrategy[m.OutputExtras]:
    events = st.lists(st.builds(m.RequestEvent, st.sampled_from(m.RequestEventType), DOUBLE), max_size=3)
    return st.builds(m.OutputExtras, new_logprobs=st.lists(token_logprobs(), max_size=2),
                     finish_reason=st.sampled_from(m.FinishReason), stop_reason=st.none() | INT32,
                     num_cached_tokens=INT32, events=events, error_message=TEXT, error_code=TEXT)


def scheduler_stats() -> st.SearchStrategy[m.SchedulerStats]:
    return st.builds(m.SchedulerStats, num_running_reqs=INT32, num_waiting_reqs=INT32, kv_cache_usage=FLOAT32,
                     prefix_cache_queries=INT64, prefix_cache_hits=INT64, num_preemptions=INT64,
                     num_free_blocks=INT32, num_total_blocks=INT32, num_steps=INT64)


# --- arbitrary protobuf messages ---------------------------------------------------------------------
_FD = descriptor.FieldDescriptor
_SCALARS = {
    _FD.TYPE_INT32: SMALL_OR_INT32, _FD.TYPE_INT64: st.integers(-2, 6) | INT64, _FD.TYPE_BOOL: st.booleans(),
    _FD.TYPE_STRING: st.sampled_from(["", "a", "b"]) | TEXT, _FD.TYPE_FLOAT: st.floats(width=32),
    _FD.TYPE_DOUBLE: st.floats(), _FD.TYPE_ENUM: SMALL_OR_INT32,  # proto3 enums keep unknown values
}


def arbitrary_message(cls: Any, max_depth: int = 3) -> st.SearchStrategy[Any]:
    """Instances of the generated message class `cls` with any values in any of its fields (unknown
    enum numbers, columns of unequal lengths, negative counts), nested `max_depth` deep."""
    fields = {f.name: _field_values(f, max_depth) for f in cls.DESCRIPTOR.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: cls(**values))


def _field_values(field: descriptor.FieldDescriptor, max_depth: int) -> st.SearchStrategy[Any]:
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        key, value = message.fields_by_name["key"], message.fields_by_name["value"]
        return st.dictionaries(_single_value(key, max_depth), _single_value(value, max_depth), max_size=3)
    one = _single_value(field, max_depth)
    return st.lists(one, max_size=5) if field.is_repeated else one


def _single_value(field: descriptor.FieldDescriptor, max_depth: int) -> st.SearchStrategy[Any]:
    if field.type == _FD.TYPE_MESSAGE:
        cls = _message_class(field.message_type)
        return arbitrary_message(cls, max_depth - 1) if max_depth > 0 else st.builds(cls)
    return _SCALARS[field.type]


def _message_class(message: descriptor.Descriptor) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(message)
