"""Each service's spans in process, with an in-memory exporter: names, parents, timestamps, attributes."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.common.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    RequestEvent,
    RequestEventType,
    SamplingParams,
    SchedulerOutput,
)
from services.common.telemetry import context_from_traceparent, seconds_to_ns, setup_tracing, traceparent_of
from services.frontend.app import create_app
from services.frontend.errors import EngineError
from services.frontend.observability import FrontendObserver, install
from services.scheduler.request import Request
from services.scheduler.tracing import SchedulerTracer
from services.worker.tracing import WorkerTracer
from tests.frontend.fakes import FakeEngineClient, make_tokenizer, serving_model
from tests.step_outputs import outputs_from

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"


_TRACINGS = []


@pytest.fixture(autouse=True)
def _shutdown_tracings():
    yield
    while _TRACINGS:
        _TRACINGS.pop().shutdown()  # stops the exporter threads


class Traced:
    """A Tracing with an in-memory exporter; `spans()` flushes and returns what ended, by name."""

    def __init__(self, service: str):
        self.exporter = InMemorySpanExporter()
        self.tracing = setup_tracing(service, None, exporter=self.exporter)
        _TRACINGS.append(self.tracing)

    def spans(self) -> dict:
        self.tracing.provider.force_flush()
        finished = self.exporter.get_finished_spans()
        named = {s.name: s for s in finished}
        assert len(named) == len(finished), [s.name for s in finished]
        return named


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def traceparent_naming(span) -> str:
    """The traceparent that names a finished span as the parent."""
    return f"00-{hex_id(span.context.trace_id, 32)}-{hex_id(span.context.span_id, 16)}-01"


def engine_request(request_id: str = "r1", traceparent: str = TRACEPARENT) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3, 4], SamplingParams(max_tokens=3), arrival_time=0.0,
                             traceparent=traceparent)


# --- scheduler ---------------------------------------------------------------------------------------
def test_scheduler_spans_follow_the_request_events():
    t = Traced("spindle-scheduler")
    tracer = SchedulerTracer(t.tracing)
    request = Request(engine_request())
    tracer.on_add(request)
    assert request.traceparent != TRACEPARENT and TRACE_ID in request.traceparent  # the worker's parent now
    queued = request.events[0].timestamp - 5.0  # in the past, as real events are by the time they arrive
    scheduled = queued + 0.25
    tracer.on_outputs(outputs_from([EngineCoreOutput("r1", [], events=[
        RequestEvent(RequestEventType.QUEUED, queued), RequestEvent(RequestEventType.SCHEDULED, scheduled)])]))
    tracer.on_outputs(EngineCoreOutputs(["r1"], [[7]]))  # new tokens only
    tracer.on_outputs(outputs_from([EngineCoreOutput("r1", [8], events=[
        RequestEvent(RequestEventType.PREEMPTED, scheduled + 1), RequestEvent(RequestEventType.SCHEDULED, scheduled + 2)])]))
    tracer.on_outputs(outputs_from([EngineCoreOutput("r1", [9], finish_reason=FinishReason.LENGTH,
                                                          num_cached_tokens=2)]))
    assert tracer.num_open_spans == 0

    spans = t.spans()
    root = spans["scheduler.request"]
    assert hex_id(root.context.trace_id, 32) == TRACE_ID and hex_id(root.parent.span_id, 16) == CALLER_SPAN_ID
    assert traceparent_naming(root) == request.traceparent
    for phase in ("scheduler.queue", "scheduler.prefill", "scheduler.decode"):
        assert spans[phase].parent.span_id == root.context.span_id, phase
    assert spans["scheduler.queue"].start_time == seconds_to_ns(queued)
    assert spans["scheduler.queue"].end_time == seconds_to_ns(scheduled) == spans["scheduler.prefill"].start_time
    assert spans["scheduler.prefill"].end_time == spans["scheduler.decode"].start_time
    assert [e.name for e in root.events] == ["preempted", "resumed"]
    assert dict(root.attributes).items() >= {"spindle.finish_reason": "length", "spindle.num_output_tokens": 3,
                                          "spindle.num_preemptions": 1, "spindle.num_cached_tokens": 2,
                                          "spindle.request_id": "r1", "spindle.num_prompt_tokens": 4}.items()


def test_scheduler_ends_aborted_and_failed_requests_and_skips_untraced_ones():
    t = Traced("spindle-scheduler")
    tracer = SchedulerTracer(t.tracing)
    aborted, failed = Request(engine_request("a")), Request(engine_request("f"))
    untraced = Request(engine_request("u", traceparent=""))
    unsampled = Request(engine_request("s", traceparent=f"00-{TRACE_ID}-{CALLER_SPAN_ID}-00"))
    for request in (aborted, failed, untraced, unsampled):
        tracer.on_add(request)
    assert untraced.traceparent == "" and unsampled.traceparent.endswith("-00")  # left as they came
    assert tracer.num_open_spans == 2
    tracer.on_aborted(["a", "never-seen"])
    tracer.on_outputs(outputs_from([EngineCoreOutput("f", [], finish_reason=FinishReason.ERROR,
                                                          error_message="boom", error_code="internal")]))
    assert tracer.num_open_spans == 0
    t.tracing.provider.force_flush()
    ended = {s.attributes["spindle.request_id"]: s for s in t.exporter.get_finished_spans()}
    assert set(ended) == {"a", "f"}
    assert ended["a"].attributes["spindle.finish_reason"] == "abort"
    assert ended["f"].status.status_code == StatusCode.ERROR and ended["f"].status.description == "boom"


# --- worker ------------------------------------------------------------------------------------------
def test_worker_span_is_a_child_of_the_traceparent_and_sums_its_steps():
    t = Traced("spindle-worker")
    tracer = WorkerTracer(t.tracing)
    new = NewRequestData("r1", list(range(20)), SamplingParams(), [1, 2], 0, traceparent=TRACEPARENT)
    untraced = NewRequestData("r2", [1], SamplingParams(), [3], 0)
    step = SchedulerOutput(scheduled_new_reqs=[new, untraced], num_scheduled_tokens={"r1": 20, "r2": 1},
                           total_num_scheduled_tokens=21, step_id=1)
    tracer.on_step(step, ModelRunnerOutput(forward_ns=5_000_000), 100.0, 100.01)
    for step_id in (2, 3):
        tracer.on_step(SchedulerOutput(num_scheduled_tokens={"r1": 1, "r2": 1}, total_num_scheduled_tokens=2,
                                       step_id=step_id), ModelRunnerOutput(), 100.0 + step_id, 100.005 + step_id)
    assert tracer.num_open_spans == 1  # r2 carried no traceparent
    tracer.on_step(SchedulerOutput(finished_req_ids={"r1", "r2"}, step_id=4), ModelRunnerOutput(), 200.0, 200.0)
    assert tracer.num_open_spans == 0

    span = t.spans()["worker.execute"]
    assert hex_id(span.parent.span_id, 16) == CALLER_SPAN_ID and hex_id(span.context.trace_id, 32) == TRACE_ID
    assert span.start_time == seconds_to_ns(100.0) and span.end_time == seconds_to_ns(103.005)  # its last step
    assert span.attributes["spindle.worker.num_steps"] == 3
    assert span.attributes["spindle.worker.num_computed_tokens"] == 22
    (event,) = span.events  # one event per prefill chunk; decode steps are only summed
    assert event.name == "prefill_chunk" and event.attributes["spindle.num_tokens"] == 20
    assert event.attributes["spindle.batch_size"] == 2 and event.attributes["spindle.forward_time_s"] == 0.005


def test_worker_reset_closes_open_spans():
    t = Traced("spindle-worker")
    tracer = WorkerTracer(t.tracing)
    new = NewRequestData("r1", [1, 2], SamplingParams(), [1], 0, traceparent=TRACEPARENT)
    tracer.on_step(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"r1": 2},
                                   total_num_scheduled_tokens=2), ModelRunnerOutput(), 1.0, 2.0)
    tracer.reset()
    assert tracer.num_open_spans == 0
    assert t.spans()["worker.execute"].attributes["spindle.worker.end"] == "dropped"


def test_traceparent_round_trip_keeps_the_trace():
    t = Traced("x")
    parent = t.tracing.tracer.start_span("parent", context=context_from_traceparent(TRACEPARENT))
    child = t.tracing.tracer.start_span("child", context=context_from_traceparent(traceparent_of(parent)[0]))
    assert child.parent.span_id == parent.context.span_id and child.context.trace_id == parent.context.trace_id


# --- frontend ----------------------------------------------------------------------------------------
def run_app(engine: FakeEngineClient, traced: Traced, body: dict, path: str = "/v1/chat/completions"):
    async def scenario():
        observer = FrontendObserver(engine, "fake-model", traced.tracing)
        engine.observer = observer
        app = create_app(engine, serving_model(engine.tokenizer), observer=observer)
        install(app, observer)
        async with TestClient(TestServer(app)) as client:
            response = await client.post(path, json={"model": "fake-model", **body},
                                         headers={"traceparent": TRACEPARENT})
            payload = await response.json()
            metrics = await (await client.get("/metrics")).text()
        return response.status, payload, metrics

    return asyncio.run(scenario())


def test_genai_span_of_a_chat_with_two_choices():
    traced = Traced("spindle-frontend")
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    status, response, metrics = run_app(engine, traced, {
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "temperature": 0.5,
        "top_p": 0.8, "seed": 7})
    assert status == 200, response
    spans = traced.spans()
    http, genai = spans["POST /v1/chat/completions"], spans["chat fake-model"]
    assert http.kind == SpanKind.SERVER and hex_id(http.parent.span_id, 16) == CALLER_SPAN_ID
    assert http.attributes["http.response.status_code"] == 200 and http.attributes["http.route"] == \
        "/v1/chat/completions"
    assert genai.parent.span_id == http.context.span_id
    a = genai.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "spindle"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "fake-model"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.top_p"], a["gen_ai.request.seed"]) == \
        (3, pytest.approx(0.8), 7)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5) and a["gen_ai.request.choice.count"] == 2
    assert a["gen_ai.response.id"] == response["id"]
    assert list(a["gen_ai.response.finish_reasons"]) == [c["finish_reason"] for c in response["choices"]]
    assert a["gen_ai.usage.input_tokens"] == response["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == response["usage"]["completion_tokens"] == 6
    # Both engine requests carry the GenAI span as their parent.
    assert {r.traceparent for r in engine.requests} == {traceparent_naming(genai)}
    assert 'spindle:request_success_total{finished_reason="length",model_name="fake-model"} 2.0' in metrics


def test_failed_request_marks_the_span_and_counts_an_error():
    traced = Traced("spindle-frontend")
    engine = FakeEngineClient(make_tokenizer(), "Hello world.")
    engine.fail_after = 1
    engine.failure = EngineError("worker died", "unavailable")
    status, _, metrics = run_app(engine, traced, {"prompt": "hi", "max_tokens": 5}, path="/v1/completions")
    assert status == 503
    spans = traced.spans()
    genai = spans["text_completion fake-model"]
    assert genai.status.status_code == StatusCode.ERROR and genai.attributes["error.type"] == "unavailable"
    assert list(genai.attributes["gen_ai.response.finish_reasons"]) == ["error"]
    assert spans["POST /v1/completions"].attributes["http.response.status_code"] == 503
    assert 'spindle:request_success_total{finished_reason="error",model_name="fake-model"} 1.0' in metrics


def test_codec_carries_the_worker_traceparent():
    from services.common import worker_codec

    new = NewRequestData("r1", [1, 2], SamplingParams(), [1], 0, traceparent=TRACEPARENT)
    decoded = worker_codec.scheduler_output_from_pb(worker_codec.scheduler_output_to_pb(SchedulerOutput(
        scheduled_new_reqs=[new], num_scheduled_tokens={"r1": 2}, total_num_scheduled_tokens=2)))
    assert decoded.scheduled_new_reqs[0].traceparent == TRACEPARENT
