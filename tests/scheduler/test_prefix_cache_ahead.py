"""Prompt blocks join the prefix cache when their step is scheduled, not when its output is back:
a request admitted later in the same step, or in the next step while the first runs, finds them.
A request or a step that does not run takes its blocks back out, and whoever read them starts over."""
from services.common.messages import ModelRunnerOutput
from tests.scheduler.factories import (
    RequestStatus,
    assert_all_blocks_free,
    fake_runner_output,
    make_requests,
    make_scheduler,
    run_to_completion,
)

SHARED = list(range(2000, 2064))  # four full blocks of 16


def admit_together():
    """Two requests sharing four blocks, admitted by one step: the second hits the first's blocks."""
    scheduler = make_scheduler()
    first, second = make_requests(2, prompt_len=5, prefix=SHARED, max_tokens=2)
    scheduler.add_request(first)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 64]
    return scheduler, first, second, out


def admit_while_in_flight():
    """The first request's whole prompt (two full blocks and a part) in step 1; the second, sharing
    the two blocks, arrives and is admitted by step 2, scheduled before step 1's output is back."""
    scheduler = make_scheduler(max_num_batched_tokens=40)
    (first,) = make_requests(1, prompt_len=0, prefix=SHARED[:40], max_tokens=2)
    scheduler.add_request(first)
    step1 = scheduler.schedule()
    runner1 = fake_runner_output(scheduler, step1)
    (second,) = make_requests(1, prompt_len=5, prefix=SHARED[:32], max_tokens=2)
    scheduler.add_request(second)
    step2 = scheduler.schedule()
    assert [n.num_computed_tokens for n in step2.scheduled_new_reqs] == [32]
    return scheduler, first, second, (step1, runner1), step2


def test_a_request_admitted_in_the_same_step_hits_the_blocks_that_step_computes():
    scheduler, first, second, out = admit_together()
    assert out.num_scheduled_tokens == {first.request_id: 69, second.request_id: 5}
    assert out.scheduled_new_reqs[1].block_ids[:4] == out.scheduled_new_reqs[0].block_ids[:4]
    assert second.num_cached_tokens == 64
    scheduler.update_from_output(out, fake_runner_output(scheduler, out))
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_the_next_step_hits_the_blocks_of_the_step_in_flight():
    scheduler, first, second, (step1, runner1), step2 = admit_while_in_flight()
    assert step2.num_scheduled_tokens == {second.request_id: 5, first.request_id: 1}
    scheduler.update_from_output(step1, runner1)
    scheduler.update_from_output(step2, fake_runner_output(scheduler, step2))
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_a_refused_request_takes_its_blocks_out_and_whoever_read_them_starts_over():
    scheduler, first, second, out = admit_together()
    refused = ModelRunnerOutput(req_ids=[second.request_id], sampled_token_ids=[[7]],
                                failed_reqs={first.request_id: "token id out of range"})
    outputs = scheduler.update_from_output(out, refused)
    assert first.status == RequestStatus.FINISHED
    # The second read blocks that were never written: its sampled token is dropped and it starts over.
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert second.request_id not in outputs.req_ids or not outputs.new_token_ids[
        outputs.req_ids.index(second.request_id)]
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    # The next step tells the worker and admits nobody: a step in flight could still carry an output
    # for the second, which must find it preempted. The step after resumes it from its first token.
    announced = scheduler.schedule()
    assert announced.preempted_req_ids == {second.request_id} and not announced.num_scheduled_tokens
    scheduler.update_from_output(announced, ModelRunnerOutput())
    again = scheduler.schedule()
    assert again.scheduled_cached_reqs.req_ids == [second.request_id]
    assert again.scheduled_cached_reqs.resumed_from_preemption == [True]
    assert again.scheduled_cached_reqs.num_computed_tokens == [0]
    assert again.num_scheduled_tokens == {second.request_id: 69}
    scheduler.update_from_output(again, fake_runner_output(scheduler, again))
    run_to_completion(scheduler)
    assert second.status == RequestStatus.FINISHED and second.num_output_tokens == 2
    assert_all_blocks_free(scheduler)


def test_a_failed_step_takes_its_blocks_out_and_the_step_in_flight_that_read_them_starts_over():
    scheduler, first, second, (step1, _), step2 = admit_while_in_flight()
    # Step 1 failed on the worker: the engine core fails its requests, then tells the scheduler.
    scheduler.abort_requests(list(step1.num_scheduled_tokens))
    scheduler.on_step_failed(step1)
    assert second.status == RequestStatus.PREEMPTED
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    # Step 2's output for the second is dropped; the next step recomputes it from its first token.
    scheduler.update_from_output(step2, ModelRunnerOutput(req_ids=list(step2.num_scheduled_tokens),
                                                          sampled_token_ids=[[7], [7]]))
    assert second.num_computed_tokens == 0 and second.num_output_tokens == 0
    step3 = scheduler.schedule()
    assert step3.preempted_req_ids == {second.request_id} and not step3.num_scheduled_tokens
    scheduler.update_from_output(step3, ModelRunnerOutput())
    step4 = scheduler.schedule()
    assert step4.scheduled_cached_reqs.req_ids == [second.request_id]
    assert step4.scheduled_cached_reqs.num_computed_tokens == [0]
    scheduler.update_from_output(step4, fake_runner_output(scheduler, step4))
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_blocks_of_a_request_taken_out_of_its_step_leave_the_cache():
    scheduler = make_scheduler()
    kv = scheduler.kv_cache_manager
    (request,) = make_requests(1, prompt_len=0, prefix=SHARED)
    assert kv.allocate_slots(request, 64) is not None
    kv.cache_scheduled_blocks(request, 64, step_id=3)
    assert len(kv.block_pool.cached_block_hash_to_block) == 4
    kv.forget_scheduled_blocks(request, step_id=3)
    assert not kv.block_pool.cached_block_hash_to_block
    assert kv.confirm_step(3, [], {}) == set()  # nothing left registered ahead for that step
