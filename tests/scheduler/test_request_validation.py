"""The scheduler refuses, alone and before the worker sees it, every request no frontend would send:
each rule of services/scheduler/request_validation.py has a case that breaks it, and the limits
themselves are accepted."""
from __future__ import annotations

import math

import pytest

from services.common.messages import EngineCoreRequest, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.request_validation import RequestRejected, validate_request
from services.scheduler.scheduler import Scheduler
from tests.scheduler.factories import assert_all_blocks_free, run_to_completion

VOCAB_SIZE = 1000
MAX_MODEL_LEN = 64
NAN, INF = math.nan, math.inf


def _request(prompt=(5, 6, 7), request_id="r", arrival_time=1.0, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(EngineCoreRequest(request_id, list(prompt), SamplingParams(**params), arrival_time))


def _validate(request: Request) -> None:
    validate_request(request, MAX_MODEL_LEN, VOCAB_SIZE)


# (what breaks the rule, words the refusal must contain)
BROKEN = {
    "empty request id": (dict(request_id=""), "request id"),
    "request id too long": (dict(request_id="x" * 1025), "request id"),
    "arrival_time nan": (dict(arrival_time=NAN), "arrival_time"),
    "arrival_time inf": (dict(arrival_time=INF), "arrival_time"),
    "empty prompt": (dict(prompt=()), "prompt is empty"),
    "prompt too long": (dict(prompt=[5] * (MAX_MODEL_LEN + 1)), "more than the maximum of 64"),
    "token id = vocab size": (dict(prompt=(5, VOCAB_SIZE, 7)), "prompt_token_ids: token id 1000 is outside [0, 1000)"),
    "negative token id": (dict(prompt=(5, -1)), "prompt_token_ids: token id -1"),
    "n > 1": (dict(n=2), "n must be 1"),
    "negative temperature": (dict(temperature=-0.5), "temperature"),
    "temperature past 2": (dict(temperature=2.5), "temperature"),
    "nan temperature": (dict(temperature=NAN), "temperature"),
    "top_p 0": (dict(top_p=0.0), "top_p"),
    "top_p past 1": (dict(top_p=1.5), "top_p"),
    "nan top_p": (dict(top_p=NAN), "top_p"),
    "top_k -1": (dict(top_k=-1), "top_k"),
    "negative min_p": (dict(min_p=-0.1), "min_p"),
    "min_p past 1": (dict(min_p=1.1), "min_p"),
    "presence_penalty past 2": (dict(presence_penalty=2.5), "presence_penalty"),
    "nan presence_penalty": (dict(presence_penalty=NAN), "presence_penalty"),
    "frequency_penalty below -2": (dict(frequency_penalty=-3.0), "frequency_penalty"),
    "repetition_penalty 0": (dict(repetition_penalty=0.0), "repetition_penalty"),
    "infinite repetition_penalty": (dict(repetition_penalty=INF), "repetition_penalty"),
    "nan repetition_penalty": (dict(repetition_penalty=NAN), "repetition_penalty"),
    "negative max_tokens": (dict(max_tokens=-1), "max_tokens"),
    "negative min_tokens": (dict(min_tokens=-1), "min_tokens"),
    "min_tokens past max_tokens": (dict(min_tokens=9, max_tokens=8), "min_tokens (9) exceeds max_tokens (8)"),
    "seed past 64 bits": (dict(seed=2**63), "seed"),
    "logprobs past 20": (dict(logprobs=21), "logprobs"),
    "negative logprobs": (dict(logprobs=-1), "logprobs"),
    "prompt_logprobs": (dict(prompt_logprobs=1), "prompt_logprobs"),
    "stop token outside vocab": (dict(stop_token_ids=(2, VOCAB_SIZE)), "stop_token_ids: token id 1000"),
    "logit_bias key outside vocab": (dict(logit_bias={VOCAB_SIZE + 5: 1.0}), "logit_bias: token id 1005"),
    "logit_bias past 100": (dict(logit_bias={5: 101.0}), "logit_bias[5]"),
    "nan logit_bias": (dict(logit_bias={5: NAN}), "logit_bias[5]"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_rule_refuses_the_request_that_breaks_it(case):
    overrides, words = BROKEN[case]
    with pytest.raises(RequestRejected) as refused:
        _validate(_request(**overrides))
    assert refused.value.code == "invalid_argument"
    assert words in str(refused.value)


@pytest.mark.parametrize("overrides", [
    dict(), dict(temperature=0.0), dict(temperature=2.0), dict(top_p=1.0), dict(top_k=0), dict(top_k=5),
    dict(min_p=1.0), dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(repetition_penalty=1.5),
    dict(max_tokens=0, min_tokens=30),  # max_tokens 0: up to the maximum length, so any min_tokens
    dict(min_tokens=8, max_tokens=8), dict(seed=-(2**63)), dict(seed=2**63 - 1), dict(logprobs=0),
    dict(logprobs=20), dict(prompt=[0, VOCAB_SIZE - 1]), dict(prompt=[5] * MAX_MODEL_LEN),
    dict(stop_token_ids=(VOCAB_SIZE - 1,)), dict(logit_bias={0: -100.0, VOCAB_SIZE - 1: 100.0}),
])
def test_the_limits_themselves_are_accepted(overrides):
    _validate(_request(**overrides))


def test_without_a_vocabulary_only_negative_ids_are_refused():
    validate_request(_request(prompt=(5, 10**6)), MAX_MODEL_LEN, None)
    with pytest.raises(RequestRejected, match="token id -3"):
        validate_request(_request(prompt=(5, -3)), MAX_MODEL_LEN, None)


def test_the_scheduler_refuses_a_bad_request_alone_and_serves_the_rest():
    # As EngineCore builds it, with the vocabulary size from the worker's KVCacheSpec.
    scheduler = Scheduler(SchedulerConfig(), 100, 16, MAX_MODEL_LEN, VOCAB_SIZE)
    good = [_request(prompt=(10, 11, 12, 13, 14), request_id=f"good-{i}", max_tokens=3) for i in range(2)]
    scheduler.add_request(good[0])
    with pytest.raises(RequestRejected, match="outside"):
        scheduler.add_request(_request(prompt=(5, VOCAB_SIZE), request_id="rogue"))
    scheduler.add_request(good[1])
    assert set(scheduler.requests) == {good[0].request_id, good[1].request_id}  # the refused one left no trace
    outputs = run_to_completion(scheduler)
    finished = {o.request_id: o for o in outputs if o.finished}
    assert set(finished) == {r.request_id for r in good}
    assert all(len(r.all_token_ids) == r.num_prompt_tokens + 3 for r in good)
    assert_all_blocks_free(scheduler)
