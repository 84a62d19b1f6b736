from services.common.messages import RequestEventType
from services.scheduler.request import RequestStatus
from tests.scheduler.factories import (
    assert_all_blocks_free,
    fake_runner_output,
    make_requests,
    make_scheduler,
    run_to_completion,
)


def _step(scheduler):
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_runner_output(scheduler, out))
    return out


def test_fcfs_preempts_the_most_recently_admitted_request():
    # 4 usable blocks of 4 tokens; two requests of 8 prompt tokens take 2 blocks each.
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=16, enable_prefix_caching=False)
    first, second = make_requests(2, prompt_len=8, max_tokens=8)
    scheduler.add_request(first)
    scheduler.add_request(second)
    _step(scheduler)  # both prefilled: 9 tokens each now, 8 computed, blocks full
    out = scheduler.schedule()  # each needs a third block: only `second` can be evicted
    assert out.preempted_req_ids == {second.request_id}
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert list(out.num_scheduled_tokens) == [first.request_id]
    assert scheduler.waiting.peek() is second
    assert any(e.type == RequestEventType.PREEMPTED for e in second.events)
    scheduler.update_from_output(out, fake_runner_output(scheduler, out))
    run_to_completion(scheduler)
    assert first.num_output_tokens == 8 and second.num_output_tokens == 8
    assert_all_blocks_free(scheduler)


def test_resumed_request_is_sent_with_its_full_token_list():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=16, enable_prefix_caching=False)
    first, second = make_requests(2, prompt_len=8, max_tokens=3)
    scheduler.add_request(first)
    scheduler.add_request(second)
    _step(scheduler)
    _step(scheduler)  # second preempted here
    while True:
        out = scheduler.schedule()
        if second.status == RequestStatus.RUNNING:
            break
        scheduler.update_from_output(out, fake_runner_output(scheduler, out))
    cached = out.scheduled_cached_reqs
    i = cached.req_ids.index(second.request_id)
    assert cached.resumed_from_preemption[i]
    assert cached.resumed_token_ids[i] == second.all_token_ids
    assert len(cached.new_block_ids[i]) == 3
    assert out.num_scheduled_tokens[second.request_id] == second.num_tokens == 9


def test_priority_policy_preempts_the_lowest_priority_request():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=16, policy="priority",
                               enable_prefix_caching=False)
    (low,) = make_requests(1, prompt_len=8, max_tokens=8, priority=5)
    (high,) = make_requests(1, prompt_len=8, max_tokens=8, priority=0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    out = _step(scheduler)
    assert list(out.num_scheduled_tokens) == [high.request_id, low.request_id]
    out = scheduler.schedule()
    assert out.preempted_req_ids == {low.request_id}
    assert list(out.num_scheduled_tokens) == [high.request_id]


def test_priority_order_is_respected_when_admitting():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    reqs = [make_requests(1, priority=p)[0] for p in (3, 1, 2)]
    for r in reqs:
        scheduler.add_request(r)
    order = []
    while scheduler.has_unfinished_requests():
        out = _step(scheduler)
        for new in out.scheduled_new_reqs:
            order.append(new.req_id)
    assert order == [reqs[1].request_id, reqs[2].request_id, reqs[0].request_id]


def test_no_new_admissions_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=16, enable_prefix_caching=False)
    a, b = make_requests(2, prompt_len=8, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    _step(scheduler)
    (c,) = make_requests(1, prompt_len=2, max_tokens=2)
    scheduler.add_request(c)
    out = scheduler.schedule()
    assert out.preempted_req_ids and not out.scheduled_new_reqs
