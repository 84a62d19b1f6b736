"""Traces and metrics across the three services, on the embedded model, in one cluster.

The cluster exports spans to a real OTLP/gRPC receiver running in this test process, and serves
metrics on the frontend's HTTP port and the scheduler's and worker's own metrics ports. The last
test (marked slow) has a real Prometheus server (Debian's `prometheus` package) scrape all three.
"""
from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.common.pb import generate_pb2, generate_pb2_grpc
from tests.e2e.cluster import SpindleCluster, free_port, free_ports
from tests.observability.otlp_receiver import SPAN_KIND_CLIENT, SPAN_KIND_SERVER, OtlpReceiver, ReceivedSpan
from tests.observability.scrapes import ENGINE_COUNTERS, engine_counters, poll_until, scrape, value

SERVICES = {"spindle-frontend", "spindle-scheduler", "spindle-worker"}
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


class ObservedCluster(SpindleCluster):
    """A cluster whose scheduler and worker each get their own metrics port (one SPINDLE_METRICS_PORT
    variable cannot give two services different ports)."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        super().__init__(log_dir, env)
        self.metrics_ports = dict(zip(("scheduler", "worker"), free_ports(2)))

    def start_service(self, name: str):
        shared = self.env
        self.env = {**shared, "SPINDLE_METRICS_PORT": str(self.metrics_ports.get(name, 0))}
        try:
            return super().start_service(name)
        finally:
            self.env = shared


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, receiver):
    c = ObservedCluster(tmp_path_factory.mktemp("observability"), env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s instead of 5 s
        "SPINDLE_KV_CACHE_BYTES": str(64 * 2**20),
        "SPINDLE_MAX_MODEL_LEN": "1024",
    })
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def model_name(cluster) -> str:
    with urllib.request.urlopen(cluster.base_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def post(cluster, path: str, body: dict, headers: dict | None = None) -> bytes:
    request = urllib.request.Request(cluster.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.read()


def sse_chunks(raw: bytes) -> list[dict]:
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]  # one span of each name per request
    return named


def assert_request_subtree(spans: dict[str, ReceivedSpan], genai: ReceivedSpan) -> None:
    """scheduler.request under the GenAI span; its phases and the worker's span under it."""
    scheduler = spans["scheduler.request"]
    assert scheduler.service == "spindle-scheduler" and scheduler.parent_span_id == genai.span_id
    for phase in ("scheduler.queue", "scheduler.prefill", "scheduler.decode"):
        assert spans[phase].service == "spindle-scheduler"
        assert spans[phase].parent_span_id == scheduler.span_id, phase
    worker = spans["worker.execute"]
    assert worker.service == "spindle-worker" and worker.parent_span_id == scheduler.span_id
    assert "prefill_chunk" in worker.event_names
    assert worker.attributes["spindle.worker.num_steps"] >= 2
    # The phases follow each other (one machine, one clock; 1 ms of slack for rounding).
    queue, prefill, decode = spans["scheduler.queue"], spans["scheduler.prefill"], spans["scheduler.decode"]
    assert queue.end_ns <= prefill.end_ns <= decode.start_ns + 1_000_000 <= decode.end_ns + 1_000_000
    assert genai.start_ns <= scheduler.start_ns and scheduler.end_ns <= genai.end_ns + 1_000_000


def test_streamed_chat_is_one_trace_across_three_services(cluster, receiver, model_name):
    traceparent, trace_id, caller_span_id = new_traceparent()
    raw = post(cluster, "/v1/chat/completions", {
        "model": model_name, "messages": PROMPT, "max_tokens": 6, "temperature": 0, "top_p": 0.9,
        "stream": True, "stream_options": {"include_usage": True},
    }, headers={"traceparent": traceparent})
    chunks = sse_chunks(raw)
    usage = chunks[-1]["usage"]
    finish_reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    response_id = chunks[0]["id"]
    names = {"POST /v1/chat/completions", f"chat {model_name}", "scheduler.request", "scheduler.queue",
             "scheduler.prefill", "scheduler.decode", "worker.execute"}

    spans = receiver.wait_for(lambda got: names <= {s.name for s in got if s.trace_id == trace_id})
    # Every span of this request is in the caller's trace, and nothing else is.
    request_id = response_id
    mine = [s for s in spans if s.attributes.get("spindle.request_id") == request_id
            or s.attributes.get("gen_ai.response.id") == response_id]
    assert mine and {s.trace_id for s in mine} == {trace_id}
    in_trace = [s for s in spans if s.trace_id == trace_id]
    assert {s.service for s in in_trace} == SERVICES
    named = by_name(in_trace)
    assert set(named) == names

    http = named["POST /v1/chat/completions"]
    assert http.service == "spindle-frontend" and http.kind == SPAN_KIND_SERVER
    assert http.parent_span_id == caller_span_id  # the incoming traceparent is the parent
    assert http.attributes["http.response.status_code"] == 200
    genai = named[f"chat {model_name}"]
    assert genai.service == "spindle-frontend" and genai.parent_span_id == http.span_id
    assert_request_subtree(named, genai)

    a = genai.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "spindle"
    assert a["gen_ai.request.model"] == model_name == a["gen_ai.response.model"]
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.response.id"] == response_id
    assert a["gen_ai.response.finish_reasons"] == [finish_reason]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert named["scheduler.request"].attributes["spindle.num_output_tokens"] == usage["completion_tokens"]
    assert 0 < a["spindle.latency.time_to_first_token"] < (genai.end_ns - genai.start_ns) / 1e9


def test_grpc_generate_accepts_traceparent_in_metadata(cluster, receiver, model_name):
    traceparent, trace_id, caller_span_id = new_traceparent()
    with grpc.insecure_channel(cluster.frontend_grpc_addr) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(text="The capital of France is", sampling_params=(
            generate_pb2.GenerateRequest.SamplingParams(temperature=0, max_tokens=4)))
        responses = list(stub.Generate(request, metadata=[("traceparent", traceparent)], timeout=60))
    names = {"/spindle.v1.GenerateService/Generate", f"text_completion {model_name}", "scheduler.request",
             "scheduler.queue", "scheduler.prefill", "scheduler.decode", "worker.execute"}
    spans = receiver.wait_for(lambda got: names <= {s.name for s in got if s.trace_id == trace_id})
    named = by_name([s for s in spans if s.trace_id == trace_id])
    server = named["/spindle.v1.GenerateService/Generate"]
    assert server.service == "spindle-frontend" and server.kind == SPAN_KIND_SERVER
    assert server.parent_span_id == caller_span_id
    genai = named[f"text_completion {model_name}"]
    assert genai.parent_span_id == server.span_id
    assert genai.attributes["gen_ai.usage.output_tokens"] == responses[-1].num_completion_tokens == 4
    assert genai.attributes["gen_ai.usage.input_tokens"] == responses[-1].num_prompt_tokens
    assert_request_subtree(named, genai)


def test_startup_handshake_carries_context_in_grpc_metadata(cluster, receiver):
    """The scheduler's DescribeKVCache call and the worker's handling of it are one trace."""
    def handshake(spans):
        return [s for s in spans if s.name == "/spindle.v1.WorkerService/DescribeKVCache"]

    spans = receiver.wait_for(lambda got: {s.service for s in handshake(got)} >= {"spindle-scheduler",
                                                                                "spindle-worker"})
    clients = [s for s in handshake(spans) if s.kind == SPAN_KIND_CLIENT]
    servers = [s for s in handshake(spans) if s.kind == SPAN_KIND_SERVER]
    assert {s.service for s in clients} == {"spindle-scheduler"} and {s.service for s in servers} == {"spindle-worker"}
    # Calls made before the worker listened have no server side; every server span has its caller.
    for server in servers:
        client = next(c for c in clients if c.span_id == server.parent_span_id)
        assert client.trace_id == server.trace_id
    # Health checks, stats polls and the long-lived streams are not traced.
    assert not [s for s in spans if "Health" in s.name or "GetStats" in s.name or "Connect" in s.name
                or "ExecuteModel" in s.name]


# --- metrics -----------------------------------------------------------------------------------------
def frontend_in_step_with_scheduler(cluster, model_name: str) -> dict:
    """A frontend scrape whose engine counters equal the scheduler's own, the engine being idle.

    The frontend hears the engine's counters with each step's outputs and from a stats poll every
    second, so a step that sends no outputs (the one telling the worker a request finished) reaches
    it only with the next poll."""
    scheduler_url = f"http://127.0.0.1:{cluster.metrics_ports['scheduler']}/metrics"
    expected = engine_counters(scrape(scheduler_url), model_name)
    assert None not in expected.values(), expected
    frontend = poll_until(lambda: scrape(cluster.base_url + "/metrics"),
                          lambda got: engine_counters(got, model_name) == expected,
                          f"the frontend's engine counters did not reach the scheduler's {expected}")
    # Still the scheduler's values: nothing ran meanwhile, so the frontend matched a settled engine.
    assert engine_counters(scrape(scheduler_url), model_name) == expected
    return frontend


HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds")


def test_frontend_metrics_move_by_the_right_amounts(cluster, model_name):
    before = frontend_in_step_with_scheduler(cluster, model_name)
    bodies = [("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 5}),
              ("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 5}),  # a prefix cache hit
              ("/v1/completions", {"prompt": "Paris is the capital of", "max_tokens": 3})]
    usages = []
    for path, body in bodies:
        usages.append(json.loads(post(cluster, path, {"model": model_name, "temperature": 0, **body}))["usage"])
    after = frontend_in_step_with_scheduler(cluster, model_name)
    lbl = {"model_name": model_name}

    def delta(family: str, sample: str, **labels) -> float:
        return value(after, family, sample, **lbl, **labels) - value(before, family, sample, **lbl, **labels)

    for name in HISTOGRAMS:
        assert after[f"spindle:{name}"][0] == "histogram", name
    for name in ("prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions"):
        assert after[f"spindle:{name}"][0] == "counter", name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"spindle:{name}"][0] == "gauge", name

    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert completion == 5 + 5 + 3  # every request ran to max_tokens
    assert delta("spindle:prompt_tokens", "spindle:prompt_tokens_total") == prompt
    assert delta("spindle:generation_tokens", "spindle:generation_tokens_total") == completion
    assert delta("spindle:request_success", "spindle:request_success_total", finished_reason="length") == 3
    assert delta("spindle:request_success", "spindle:request_success_total", finished_reason="stop") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "time_per_output_token_seconds"):
        assert delta(f"spindle:{name}", f"spindle:{name}_count") == 3, name
    assert delta("spindle:inter_token_latency_seconds", "spindle:inter_token_latency_seconds_count") == completion - 3
    e2e_sum = delta("spindle:e2e_request_latency_seconds", "spindle:e2e_request_latency_seconds_sum")
    ttft_sum = delta("spindle:time_to_first_token_seconds", "spindle:time_to_first_token_seconds_sum")
    assert 0 < ttft_sum < e2e_sum
    # The engine's counters, as the frontend last heard them: lookups are prompt tokens, hits cached ones.
    assert delta("spindle:prefix_cache_queries", "spindle:prefix_cache_queries_total") == prompt
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0 and delta("spindle:prefix_cache_hits", "spindle:prefix_cache_hits_total") == cached
    assert value(after, "spindle:num_requests_running", "spindle:num_requests_running", **lbl) == 0
    assert 0 <= value(after, "spindle:kv_cache_usage_perc", "spindle:kv_cache_usage_perc", **lbl) <= 1


def test_scheduler_and_worker_metrics_ports(cluster, model_name):
    lbl = {"model_name": model_name}
    scheduler = scrape(f"http://127.0.0.1:{cluster.metrics_ports['scheduler']}/metrics")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert scheduler[f"spindle:{name}"][0] == "gauge"
    for name in ENGINE_COUNTERS:
        assert scheduler[f"spindle:{name}"][0] == "counter"
    # The frontend's copies of the engine counters catch up with the scheduler's (or this raises).
    frontend_in_step_with_scheduler(cluster, model_name)
    assert value(scheduler, "spindle:engine_worker_alive", "spindle:engine_worker_alive") == 1
    assert "spindle:time_to_first_token_seconds" not in scheduler  # request latencies live in the frontend

    worker = scrape(f"http://127.0.0.1:{cluster.metrics_ports['worker']}/metrics")
    assert worker["spindle:iteration_tokens_total"][0] == "histogram"
    steps = value(worker, "spindle:worker_steps", "spindle:worker_steps_total", **lbl)
    assert steps > 0
    assert value(worker, "spindle:worker_step_time_seconds", "spindle:worker_step_time_seconds_count", **lbl) == steps
    assert value(worker, "spindle:iteration_tokens_total", "spindle:iteration_tokens_total_sum", **lbl) >= steps


@pytest.mark.slow
def test_a_real_prometheus_scrapes_all_three(cluster, model_name, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    post(cluster, "/v1/completions", {"model": model_name, "prompt": "Hello", "max_tokens": 2})
    targets = [f"127.0.0.1:{cluster.http_port}", f"127.0.0.1:{cluster.metrics_ports['scheduler']}",
               f"127.0.0.1:{cluster.metrics_ports['worker']}"]
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: spindle\n"
                      f"    static_configs:\n      - targets: {json.dumps(targets)}\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))

    def query(expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.load(resp)["data"]["result"]
        except OSError:
            return []

    def scraped() -> tuple[dict, bool]:
        return {r["metric"]["instance"]: r["value"][1] for r in query("up")}, bool(query("spindle:prompt_tokens_total"))

    try:
        try:
            poll_until(scraped, lambda got: got == ({t: "1" for t in targets}, True),
                       "Prometheus did not scrape all three targets", timeout_s=60)
        except TimeoutError as exc:
            raise AssertionError((tmp_path / "prometheus.log").read_text()) from exc
        # Nothing ran since the request above: Prometheus holds the frontend's current count.
        prompt_tokens = value(scrape(cluster.base_url + "/metrics"), "spindle:prompt_tokens",
                              "spindle:prompt_tokens_total", model_name=model_name)
        assert [float(r["value"][1]) for r in query("spindle:prompt_tokens_total")] == [prompt_tokens]
        assert {r["metric"]["instance"] for r in query("spindle:num_requests_running")} == set(targets[:2])
        assert query("spindle:worker_steps_total")
        assert query('histogram_quantile(0.5, sum by (le) (spindle:time_to_first_token_seconds_bucket))')
    finally:
        proc.terminate()
        proc.wait(10)
