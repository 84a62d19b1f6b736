"""A request whose inputs would make the step raise fails alone: the runner refuses it before the
forward (services/worker/input_checks.py), reports it in `failed_reqs`, and the step's other
requests get their tokens, the same as transformers' greedy ones. The scheduler ends the refused
request with an error of its own and serves the rest. Requests here bypass the scheduler's own
validation (services/scheduler/request_validation.py), as a request reaching the worker anyway would."""
from __future__ import annotations

import math
from collections import deque

import pytest
import torch

from services.common import worker_codec
from services.common.messages import (
    CachedRequestData,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker import model_runner
from services.worker.fake_runner import FakeModelRunner
from services.worker.kv_cache import KVCacheLayout
from tests.step_outputs import per_request
from tests.worker.harness import VOCAB_SIZE, hf_greedy, make_runner

GREEDY = SamplingParams(temperature=0.0)
NUM_BLOCKS = 128
MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings
BLOCK_SIZE = 4
PROMPT_A = [5, 17, 99, 250, 7, 33]
PROMPT_B = [300, 12, 8, 41, 77, 150, 3, 9, 60]


def _new(req_id: str, prompt: list[int], block_ids: list[int], params: SamplingParams = GREEDY,
         num_computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, prompt, params, block_ids, num_computed)


def _first_step(*new_reqs: NewRequestData, step_id: int = 1) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=list(new_reqs),
                           num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) - r.num_computed_tokens
                                                 for r in new_reqs},
                           total_num_scheduled_tokens=sum(len(r.prompt_token_ids) for r in new_reqs), step_id=step_id)


@pytest.fixture(scope="module")
def expected_a(tiny_llama_dir) -> list[int]:
    return hf_greedy(tiny_llama_dir, PROMPT_A, 3)


# A rogue request beside the good one, and words its refusal must contain.
BAD_REQUESTS = {
    "token id = vocab size": (_new("bad", [5, VOCAB_SIZE, 7], [3]), f"token id {VOCAB_SIZE} is outside the vocabulary"),
    "negative token id": (_new("bad", [5, -4], [3]), "token id -4 is outside the vocabulary"),
    "block id past the cache": (_new("bad", [5, 6], [NUM_BLOCKS]), f"block id {NUM_BLOCKS} is outside the KV cache"),
    "negative block id": (_new("bad", [5, 6], [-1]), "block id -1 is outside the KV cache"),
    "longer than max_model_len": (_new("bad", [5] * (MAX_MODEL_LEN + 1), list(range(3, 70))),
                                  f"more than max_model_len ({MAX_MODEL_LEN})"),
    "more blocks than max_model_len needs": (_new("bad", [5, 6], list(range(3, 3 + MAX_MODEL_LEN // BLOCK_SIZE + 1))),
                                             "blocks, more than max_model_len needs"),
    "more computed tokens than known": (_new("bad", [5, 6], [3], num_computed=5), "5 computed tokens of 2"),
    "too few blocks for the tokens": (_new("bad", [5] * 9, [3, 4]), "exceed"),
    "stop token outside vocab": (_new("bad", [5, 6], [3], SamplingParams(temperature=0.0, min_tokens=2,
                                                                          stop_token_ids=(VOCAB_SIZE + 1,))),
                                 "stop_token_ids: token id"),
    "logit_bias outside vocab": (_new("bad", [5, 6], [3], SamplingParams(logit_bias={VOCAB_SIZE: 5.0})),
                                 "logit_bias: token id"),
    "nan temperature": (_new("bad", [5, 6], [3], SamplingParams(temperature=math.nan)), "not a finite number"),
    "top_p 0": (_new("bad", [5, 6], [3], SamplingParams(top_p=0.0)), "out of range"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_request_the_runner_cannot_run_fails_alone(case, tiny_llama_dir, expected_a):
    bad, words = BAD_REQUESTS[case]
    runner = make_runner(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    good = _new("a", PROMPT_A, [1, 2])
    out = runner.execute_model(_first_step(bad, good))
    assert list(out.failed_reqs) == ["bad"] and words in out.failed_reqs["bad"], out.failed_reqs
    assert out.req_ids == ["a"] and out.sampled_token_ids == [expected_a[:1]]
    assert set(runner.requests) == {"a"} and runner.input_batch.num_reqs == 1
    # The next step, sent before the scheduler heard, still names the failed request: it is skipped.
    out = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["bad", "a"], [False, False], [[], []], [2, len(PROMPT_A)], []),
        num_scheduled_tokens={"bad": 1, "a": 1}, total_num_scheduled_tokens=2, step_id=2))
    assert out.req_ids == ["a"] and out.sampled_token_ids == [expected_a[1:2]] and not out.failed_reqs
    # Once the scheduler reports it finished, the runner forgets it.
    runner.execute_model(SchedulerOutput(finished_req_ids={"bad"}, step_id=3))
    assert runner.failed_req_ids == set()


def test_without_the_check_the_bad_token_fails_the_whole_step(tiny_llama_dir, monkeypatch):
    """What the check prevents: the embedding lookup raises, and the good request's step fails with it."""
    monkeypatch.setattr(model_runner, "check_new_request", lambda *args: None)
    runner = make_runner(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    with pytest.raises(IndexError):
        runner.execute_model(_first_step(*BAD_REQUESTS["token id = vocab size"][:1], _new("a", PROMPT_A, [1, 2])))


def test_a_running_request_given_a_block_outside_the_cache_fails_alone(tiny_llama_dir):
    expected = {"a": hf_greedy(tiny_llama_dir, PROMPT_A, 3), "b": hf_greedy(tiny_llama_dir, PROMPT_B, 3)}
    runner = make_runner(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    out = runner.execute_model(_first_step(_new("a", PROMPT_A, [1, 2]), _new("b", PROMPT_B, [3, 4, 5])))
    assert out.sampled_token_ids == [expected["a"][:1], expected["b"][:1]]
    # a fills its 8 slots at the next two tokens: it gets a new block, one the cache does not have.
    out = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a", "b"], [False, False], [[NUM_BLOCKS + 3], []],
                                                [len(PROMPT_A), len(PROMPT_B)], []),
        num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2, step_id=2))
    assert "outside the KV cache" in out.failed_reqs["a"]
    assert out.req_ids == ["b"] and out.sampled_token_ids == [expected["b"][1:2]]


def test_a_resumed_request_with_tokens_outside_the_vocabulary_fails_alone(tiny_llama_dir):
    expected_b = hf_greedy(tiny_llama_dir, PROMPT_B, 2)
    runner = make_runner(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    runner.execute_model(_first_step(_new("a", PROMPT_A, [1, 2]), _new("b", PROMPT_B, [3, 4, 5])))
    runner.execute_model(SchedulerOutput(preempted_req_ids={"a"}, step_id=2))
    resumed = PROMPT_A + [VOCAB_SIZE + 7]  # resent tokens, one past the vocabulary
    out = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a", "b"], [True, False], [[6, 7], []], [0, len(PROMPT_B)],
                                                [resumed, []]),
        num_scheduled_tokens={"a": len(resumed), "b": 1}, total_num_scheduled_tokens=len(resumed) + 1, step_id=3))
    assert f"token id {VOCAB_SIZE + 7} is outside the vocabulary" in out.failed_reqs["a"]
    assert out.req_ids == ["b"] and out.sampled_token_ids == [expected_b[1:2]]


def test_the_scheduler_ends_a_refused_request_with_its_error_and_serves_the_rest(tiny_llama_dir):
    """The real scheduler (no vocabulary to check against, as if its check were bypassed) and the
    real runner, two steps in flight as with async scheduling: the refused request ends with an
    internal error, the others match transformers token for token, and every block comes back."""
    runner = make_runner(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN)
    prompts = {"a": PROMPT_A, "bad": [5, 6, VOCAB_SIZE + 100, 8], "b": PROMPT_B}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(Request(EngineCoreRequest(
            req_id, prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), float(i))))
    outputs, in_flight = [], deque()
    steps, worker_end = worker_codec.StepEncoder(), worker_codec.StepDecoder()  # as over the step stream
    while scheduler.has_unfinished_requests() or in_flight:
        if scheduler.has_unfinished_requests():
            step = scheduler.schedule()
            decoded = worker_end.decode(steps.encode(step))
            in_flight.append((step, worker_end.encode_output(runner.execute_model(decoded))))
            if len(in_flight) < 2:
                continue
        step, answer = in_flight.popleft()
        outputs += per_request(scheduler.update_from_output(step, steps.decode_output(answer)))
    by_request: dict[str, list] = {}
    for output in outputs:
        by_request.setdefault(output.request_id, []).append(output)
    (refused,) = by_request["bad"]
    assert refused.finish_reason == FinishReason.ERROR and refused.error_code == "internal"
    assert refused.error_message.startswith("the worker could not run the request: token_ids: token id 612")
    for req_id in ("a", "b"):
        tokens = [t for o in by_request[req_id] for t in o.new_token_ids]
        assert tokens == hf_greedy(tiny_llama_dir, prompts[req_id], 5), req_id
        assert by_request[req_id][-1].finish_reason == FinishReason.LENGTH
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    runner.execute_model(scheduler.schedule())  # the last finishes reach the worker
    assert runner.requests == {} and runner.failed_req_ids == set()


def test_failed_requests_cross_the_step_stream():
    output = ModelRunnerOutput(["a"], [[4]], [None], step_id=9, failed_reqs={"x": "block id 99 is outside", "y": "z"})
    msg = worker_codec.model_runner_output_to_pb(output)
    assert type(msg).FromString(msg.SerializeToString()).failed_req_ids == ["x", "y"]
    assert worker_codec.model_runner_output_from_pb(type(msg).FromString(msg.SerializeToString())) == output


def test_the_fake_runner_fails_a_token_outside_its_vocabulary_alone():
    runner = FakeModelRunner(KVCacheLayout(2, 1, 8, BLOCK_SIZE, torch.float32), vocab_size=100)
    out = runner.execute_model(_first_step(_new("bad", [5, 100], [1]), _new("a", [5, 6], [2])))
    assert out.req_ids == ["a"] and "token id 100" in out.failed_reqs["bad"]
    out = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["bad", "a"], [False, False], [[], []], [2, 2], []),
        num_scheduled_tokens={"bad": 1, "a": 1}, total_num_scheduled_tokens=2, step_id=2))
    assert out.req_ids == ["a"] and not out.failed_reqs
