"""Constrained requests wait for their grammar off the step: announced once per distinct constraint,
released when a step's output reports it compiled, failed alone when it does not compile."""
from __future__ import annotations

from services.common.messages import FinishReason, ModelRunnerOutput
from services.common.structured_outputs import StructuredOutputsParams
from services.scheduler.request import RequestStatus
from tests.scheduler.factories import assert_all_blocks_free, fake_runner_output, make_requests, make_scheduler
from tests.step_outputs import per_request

SCHEMA = StructuredOutputsParams("json", '{"type": "object"}')
REGEX = StructuredOutputsParams("regex", "[a-z]+")


def test_a_hundred_requests_with_one_schema_announce_it_once_and_wait_without_stalling_others():
    scheduler = make_scheduler()
    constrained = make_requests(100, structured_outputs=SCHEMA)
    free = make_requests(2)
    for request in constrained + free:
        scheduler.add_request(request)
    assert {r.status for r in constrained} == {RequestStatus.WAITING_FOR_GRAMMAR}
    assert scheduler.get_stats().num_waiting_reqs == 102

    step = scheduler.schedule()
    assert step.grammars_to_compile == {SCHEMA.key: SCHEMA}
    assert list(step.num_scheduled_tokens) == [r.request_id for r in free]  # the others run meanwhile
    scheduler.update_from_output(step, fake_runner_output(scheduler, step))

    step = scheduler.schedule()  # still compiling: not announced again, still not scheduled
    assert step.grammars_to_compile == {}
    assert list(step.num_scheduled_tokens) == [r.request_id for r in free]
    output = fake_runner_output(scheduler, step)
    output.compiled_grammar_keys = [SCHEMA.key]
    scheduler.update_from_output(step, output)
    assert {r.status for r in constrained} == {RequestStatus.WAITING}

    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) >= {r.request_id for r in constrained}
    assert step.grammars_to_compile == {}


def test_a_compiled_constraint_is_not_announced_again():
    scheduler = make_scheduler()
    first, = make_requests(1, structured_outputs=REGEX)
    scheduler.add_request(first)
    step = scheduler.schedule()
    scheduler.update_from_output(step, ModelRunnerOutput(compiled_grammar_keys=[REGEX.key]))
    second, = make_requests(1, structured_outputs=REGEX)
    scheduler.add_request(second)
    assert second.status == RequestStatus.WAITING
    assert scheduler.schedule().grammars_to_compile == {}


def test_a_grammar_that_fails_to_compile_fails_its_requests_alone():
    scheduler = make_scheduler()
    bad = make_requests(2, structured_outputs=StructuredOutputsParams("grammar", "root ::= foo"))
    good = make_requests(1)
    for request in bad + good:
        scheduler.add_request(request)
    step = scheduler.schedule()
    output = fake_runner_output(scheduler, step)
    output.failed_grammars = {bad[0].sampling_params.structured_outputs.key: 'Rule "foo" is not defined'}
    outputs = {o.request_id: o for o in per_request(scheduler.update_from_output(step, output))}
    for request in bad:
        out = outputs[request.request_id]
        assert out.finish_reason == FinishReason.ERROR
        assert out.error_code == "invalid_argument"
        assert out.error_message == 'structured_outputs: Rule "foo" is not defined'
        assert request.request_id not in scheduler.requests
    assert good[0].request_id in scheduler.requests
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        scheduler.update_from_output(step, fake_runner_output(scheduler, step))
    assert_all_blocks_free(scheduler)


def test_an_aborted_waiting_request_leaves_and_the_result_still_releases_the_others():
    scheduler = make_scheduler()
    a, b = make_requests(2, structured_outputs=SCHEMA)
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.schedule()
    assert scheduler.abort_requests([a.request_id]) == [a]
    assert scheduler.get_stats().num_waiting_reqs == 1
    step = scheduler.schedule()
    scheduler.update_from_output(step, ModelRunnerOutput(compiled_grammar_keys=[SCHEMA.key]))
    assert a.status == RequestStatus.FINISHED and b.status == RequestStatus.WAITING


def test_a_failed_step_announces_the_awaited_constraints_again():
    scheduler = make_scheduler()
    request, = make_requests(1, structured_outputs=SCHEMA)
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert step.grammars_to_compile == {SCHEMA.key: SCHEMA}
    scheduler.on_step_failed(step)
    assert scheduler.schedule().grammars_to_compile == {SCHEMA.key: SCHEMA}


def test_fail_all_drops_the_waiting_requests():
    scheduler = make_scheduler()
    request, = make_requests(1, structured_outputs=SCHEMA)
    scheduler.add_request(request)
    assert scheduler.fail_all() == [request]
    assert scheduler.get_stats().num_waiting_reqs == 0
    assert not scheduler.has_unfinished_requests()
