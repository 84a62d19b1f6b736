from services.common.messages import FinishReason
from services.scheduler.request_validation import RequestRejected
from tests.scheduler.factories import (
    EOS,
    RequestStatus,
    assert_all_blocks_free,
    fake_runner_output,
    make_requests,
    make_scheduler,
    run_to_completion,
)
from tests.step_outputs import per_request

import pytest


def test_new_requests_are_scheduled_in_full_then_decode_one_token():
    scheduler = make_scheduler()
    for r in make_requests(3, prompt_len=20):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert len(out.scheduled_new_reqs) == 3
    assert list(out.num_scheduled_tokens.values()) == [20, 20, 20]
    assert out.total_num_scheduled_tokens == 60
    assert [len(r.block_ids) for r in out.scheduled_new_reqs] == [2, 2, 2]
    scheduler.update_from_output(out, fake_runner_output(scheduler, out))
    out2 = scheduler.schedule()
    assert not out2.scheduled_new_reqs
    assert out2.scheduled_cached_reqs.num_reqs == 3
    assert list(out2.num_scheduled_tokens.values()) == [1, 1, 1]
    assert out2.scheduled_cached_reqs.num_computed_tokens == [20, 20, 20]


def test_long_prompt_is_chunked_exactly_under_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    (req,) = make_requests(1, prompt_len=150)
    scheduler.add_request(req)
    chunks = []
    while True:
        out = scheduler.schedule()
        chunks.append(out.num_scheduled_tokens[req.request_id])
        ro = fake_runner_output(scheduler, out)
        scheduler.update_from_output(out, ro)
        if ro.sampled_token_ids[0]:
            break
    assert chunks == [64, 64, 22]
    assert req.num_output_tokens == 1


def test_mixed_step_holds_decodes_and_a_prefill_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=50)
    first = make_requests(2, prompt_len=10)
    for r in first:
        scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_runner_output(scheduler, out))
    (late,) = make_requests(1, prompt_len=100)
    scheduler.add_request(late)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {late.request_id: 48, first[0].request_id: 1, first[1].request_id: 1}
    assert out.total_num_scheduled_tokens == 50


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for r in make_requests(5):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert len(out.num_scheduled_tokens) == 2
    assert len(scheduler.waiting) == 3


def test_finishes_on_max_tokens_eos_and_stop_token_and_frees_blocks():
    scheduler = make_scheduler()
    reqs = make_requests(1, max_tokens=5)
    scheduler.add_request(reqs[0])
    outputs = run_to_completion(scheduler)
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outputs) == 5
    assert_all_blocks_free(scheduler)

    (req,) = make_requests(1, max_tokens=50)
    scheduler.add_request(req)
    out = scheduler.schedule()
    ro = fake_runner_output(scheduler, out, token_id=EOS)
    (o,) = per_request(scheduler.update_from_output(out, ro))
    assert o.finish_reason == FinishReason.STOP and o.stop_reason is None

    (req,) = make_requests(1, max_tokens=50, stop_token_ids=(7,))
    scheduler.add_request(req)
    (o,) = run_to_completion(scheduler)[-1:]
    assert o.finish_reason == FinishReason.STOP and o.stop_reason == 7
    assert_all_blocks_free(scheduler)


def test_min_tokens_and_ignore_eos_hold_back_eos():
    scheduler = make_scheduler()
    (req,) = make_requests(1, max_tokens=10, min_tokens=3)
    scheduler.add_request(req)
    finish = None
    while finish is None:
        out = scheduler.schedule()
        for o in per_request(scheduler.update_from_output(out, fake_runner_output(scheduler, out, token_id=EOS))):
            if o.finished:
                finish = o
    assert req.num_output_tokens == 3 and finish.finish_reason == FinishReason.STOP


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=14)
    (req,) = make_requests(1, prompt_len=10, max_tokens=100)
    scheduler.add_request(req)
    outputs = run_to_completion(scheduler)
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert req.num_tokens == 14


def test_abort_frees_blocks_at_once_and_reaches_the_worker():
    scheduler = make_scheduler()
    reqs = make_requests(3, prompt_len=40)
    for r in reqs:
        scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_runner_output(scheduler, out))
    scheduler.abort_requests([r.request_id for r in reqs] + ["unknown"])
    assert_all_blocks_free(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert all(r.status == RequestStatus.FINISHED and r.finish_reason == FinishReason.ABORT for r in reqs)
    out = scheduler.schedule()
    assert out.finished_req_ids == {r.request_id for r in reqs}


def test_rejects_prompts_that_can_never_run():
    scheduler = make_scheduler(max_model_len=32)
    (req,) = make_requests(1, prompt_len=33)
    with pytest.raises(RequestRejected):
        scheduler.add_request(req)
    (empty,) = make_requests(1, prompt_len=0)
    with pytest.raises(RequestRejected):
        scheduler.add_request(empty)


def test_bounded_waiting_queue_refuses_with_resource_exhausted():
    scheduler = make_scheduler(max_num_waiting_requests=2)
    reqs = make_requests(3)
    scheduler.add_request(reqs[0])
    scheduler.add_request(reqs[1])
    with pytest.raises(RequestRejected) as info:
        scheduler.add_request(reqs[2])
    assert info.value.code == "resource_exhausted"


def test_many_requests_all_finish_and_all_blocks_return():
    scheduler = make_scheduler(num_blocks=40, max_num_batched_tokens=100)
    reqs = make_requests(30, prompt_len=37, max_tokens=20)
    for r in reqs:
        scheduler.add_request(r)
    outputs = run_to_completion(scheduler)
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 30
    assert all(r.num_output_tokens == 20 for r in reqs)
    assert_all_blocks_free(scheduler)
