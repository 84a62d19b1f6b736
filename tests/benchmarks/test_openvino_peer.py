"""The OpenVINO peer's pure logic: the closed loop against a fake pipeline, the JSON the harness reads
back, the level bookkeeping and the report lines. No OpenVINO needed."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import openvino_peer, peers, report, single_stream
from benchmarks.openvino_peer import ClosedLoop


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeHandle:
    def __init__(self, max_tokens: int, status: str = "RUNNING"):
        self.max_tokens, self.status = max_tokens, status
        self.num_made, self.pending, self.is_cancelled = 0, [], False

    def can_read(self) -> bool:
        return bool(self.pending)

    def read(self) -> dict:
        reason = "LENGTH" if self.status == "FINISHED" else "NONE"
        out = {0: SimpleNamespace(generated_ids=self.pending, finish_reason=SimpleNamespace(name=reason))}
        self.pending = []
        return out

    def get_status(self):
        return SimpleNamespace(name=self.status)

    def cancel(self) -> None:
        self.is_cancelled, self.status = True, "CANCEL"


class FakePipeline:
    """Each step takes `step_s` and gives one token to each of the first `max_num_scheduled` running requests."""

    def __init__(self, clock: FakeClock, max_num_scheduled: int = 10**9, step_s: float = 1.0,
                 ignored_ids: tuple[int, ...] = ()):
        self.clock, self.max_num_scheduled, self.step_s, self.ignored_ids = clock, max_num_scheduled, step_s, ignored_ids
        self.handles: dict[int, FakeHandle] = {}  # by request index
        self.request_ids: list[int] = []
        self.metrics = SimpleNamespace(requests=0, scheduled_requests=0)

    def add_request(self, request_id, input_ids, max_tokens):
        assert request_id == len(self.request_ids) and isinstance(request_id, int)  # unsigned, never reused
        self.request_ids.append(request_id)
        index = int(input_ids.removeprefix("ids-"))
        handle = FakeHandle(max_tokens, "IGNORED" if index in self.ignored_ids else "RUNNING")
        self.handles[index] = handle
        return handle

    def step(self) -> None:
        self.clock.now += self.step_s
        running = [h for h in self.handles.values() if h.status == "RUNNING"]
        scheduled = running[:self.max_num_scheduled]
        for handle in scheduled:
            handle.num_made += 1
            handle.pending.append(7)
            if handle.num_made == handle.max_tokens:
                handle.status = "FINISHED"
        self.metrics = SimpleNamespace(requests=len(running), scheduled_requests=len(scheduled))

    def get_metrics(self):
        return self.metrics


def make_requests(max_tokens: list[int]) -> list[dict]:
    return [{"index": i, "prompt_tokens": 10 + i, "max_tokens": n} for i, n in enumerate(max_tokens)]


def make_loop(pipe: FakePipeline, clock: FakeClock) -> ClosedLoop:
    return ClosedLoop(pipe, lambda r: f"ids-{r['index']}", lambda r: r["max_tokens"], clock=clock)


def test_closed_loop_keeps_c_in_flight_and_times_each_token():
    clock = FakeClock()
    pipe = FakePipeline(clock)
    level = make_loop(pipe, clock).run(make_requests([3, 2, 4, 1, 2]), concurrency=2)

    assert level["concurrency"] == 2 and not level["is_truncated"]
    rows = level["requests"]
    assert [r["output_tokens"] for r in rows] == [3, 2, 4, 1, 2]
    assert all(r["finish_reason"] == "length" and not r["error"] and not r["cancelled"] for r in rows)
    # Request 1 ends after step 2 and request 2 starts before step 3: a finished one is replaced at once.
    assert [r["start_s"] for r in rows] == [0.0, 0.0, 2.0, 3.0, 4.0]
    assert [r["ttft_s"] for r in rows] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["e2e_s"] for r in rows] == [3.0, 2.0, 4.0, 1.0, 2.0]
    assert rows[2]["itls_s"] == [1.0, 1.0, 1.0]
    steps = level["steps"]
    assert steps["num_steps"] == 6 and steps["max_num_open"] == 2 and steps["max_num_scheduled"] == 2
    assert steps["sum_num_scheduled"] == 12 and steps["mean_num_scheduled"] == 2.0
    assert level["duration_s"] == 6.0


def test_closed_loop_records_a_pipeline_that_schedules_fewer_than_are_open():
    clock = FakeClock()
    pipe = FakePipeline(clock, max_num_scheduled=2)
    level = make_loop(pipe, clock).run(make_requests([2, 2, 2, 2]), concurrency=4)

    steps = level["steps"]
    assert steps["max_num_open"] == 4 and steps["max_num_requests"] == 4 and steps["max_num_scheduled"] == 2
    assert [r["ttft_s"] for r in level["requests"]] == [1.0, 1.0, 3.0, 3.0]  # the last two waited two steps


def test_closed_loop_cancels_open_requests_at_the_time_limit():
    clock = FakeClock()
    pipe = FakePipeline(clock)
    level = make_loop(pipe, clock).run(make_requests([5, 5, 5]), concurrency=2, time_limit_s=2.5)

    rows = level["requests"]
    assert level["is_truncated"]
    assert [r["cancelled"] for r in rows] == [True, True, True]
    assert [r["output_tokens"] for r in rows] == [3, 3, 0]  # the third never started
    assert all(r["e2e_s"] is None for r in rows)
    assert all(h.is_cancelled for h in pipe.handles.values()) and set(pipe.handles) == {0, 1}


def test_closed_loop_counts_an_ignored_request_as_an_error():
    clock = FakeClock()
    pipe = FakePipeline(clock, ignored_ids=(1,))
    rows = make_loop(pipe, clock).run(make_requests([2, 2, 2]), concurrency=2)["requests"]

    assert rows[1]["error"] == "request ended with status IGNORED" and rows[1]["output_tokens"] == 0
    assert not rows[0]["error"] and not rows[2]["error"] and rows[2]["output_tokens"] == 2


def test_summarize_level_matches_the_load_generator_summary():
    clock = FakeClock()
    level = make_loop(FakePipeline(clock), clock).run(make_requests([3, 2, 4]), concurrency=2)
    level["loadavg_1m"] = [1.0, 1.5]

    run = openvino_peer.summarize_level(level)
    s = run["summary"]
    assert s["mode"] == "concurrency" and s["concurrency"] == 2 and s["rate"] is None
    assert s["num_planned"] == 3 and s["num_complete"] == 3 and s["num_failed"] == 0 and s["is_all_complete"]
    assert s["total_output_tokens"] == 9 and s["num_at_max_tokens"] == 3
    assert s["total_input_tokens"] == 10 + 11 + 12
    assert s["output_throughput"] == pytest.approx(9 / level["duration_s"])
    assert s["ttft_ms"]["p50"] == pytest.approx(1000.0) and s["itl_ms"]["p50"] == pytest.approx(1000.0)
    assert s["scheduler"]["max_num_scheduled"] == 2 and s["loadavg_1m"] == [1.0, 1.5]
    assert all(r["complete"] and r["saw_done"] and r["usage_tokens"] == r["output_tokens"] for r in run["requests"])


def test_summarize_level_counts_cancelled_requests_as_cancelled():
    clock = FakeClock()
    level = make_loop(FakePipeline(clock), clock).run(make_requests([5, 5, 5]), concurrency=2, time_limit_s=2.5)

    s = openvino_peer.summarize_level(level)["summary"]
    assert s["num_cancelled"] == 3 and s["num_complete"] == 0 and s["num_failed"] == 0
    assert s["is_truncated"] and s["total_output_tokens"] == 6


def test_level_spec_and_grouping_follow_the_plan():
    plan = [{"concurrency": 1, "num_requests": 2, "offset": 0}, {"concurrency": 4, "num_requests": 8, "offset": 4},
            {"rate": 4.0, "num_requests": 8, "offset": 20}]
    assert openvino_peer.level_spec(plan, repeats=2) == "1:0:2,1:2:2,4:4:8,4:12:8"
    assert openvino_peer.parse_levels("1:0:2,4:4:8") == [(1, 0, 2), (4, 4, 8)]

    clock = FakeClock()
    loop = make_loop(FakePipeline(clock), clock)
    levels = [loop.run(make_requests([2]), 1), loop.run(make_requests([2]), 1),
              loop.run(make_requests([2, 2]), 4), loop.run(make_requests([2, 2]), 4)]
    groups = openvino_peer.group_levels({"levels": levels}, plan, repeats=2)
    assert [[r["summary"]["concurrency"] for r in g] for g in groups] == [[1, 1], [4, 4]]
    with pytest.raises(ValueError, match="ran 3 levels"):
        openvino_peer.group_levels({"levels": levels[:3]}, plan, repeats=2)
    with pytest.raises(ValueError, match="c=4 where c=1"):
        openvino_peer.group_levels({"levels": levels[2:] + levels[:2]}, plan, repeats=2)


@pytest.mark.parametrize("text", ["0:0:4", "4:-1:4", "4:0:0", "4:0"])
def test_parse_levels_refuses_bad_levels(text):
    with pytest.raises(ValueError):
        openvino_peer.parse_levels(text)


def test_driver_workload_sends_token_ids_of_the_chat_template():
    class Tokenizer:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            return {"input_ids": [len(m["content"]) for m in messages]}

    requests = [SimpleNamespace(index=3, messages=[{"role": "user", "content": "abc"}], max_tokens=40)]
    workload = openvino_peer.driver_workload(requests, Tokenizer(), single_stream_tokens=64)
    assert workload["requests"] == [{"index": 3, "prompt_ids": [3], "prompt_tokens": 1, "max_tokens": 40}]
    assert workload["single_stream"]["max_tokens"] == 64 and workload["warm_up"]["max_tokens"] == 8
    assert openvino_peer.driver_workload(requests, Tokenizer(), single_stream_tokens=0)["single_stream"] is None


def test_single_stream_figures():
    figures = single_stream.single_stream_figures({"output_tokens": 65, "e2e_s": 2.5, "ttft_s": 0.5})
    assert figures == {"num_tokens": 65, "e2e_s": 2.5, "ttft_ms": 500.0, "tok_s": 26.0, "decode_tok_s": 32.0}


def test_single_stream_keeps_the_median_repeat():
    rows = [{"output_tokens": 64, "e2e_s": e2e, "ttft_s": 0.1} for e2e in (2.0, 1.0, 4.0)]
    figures = single_stream.median_figures([single_stream.single_stream_figures(r) for r in rows])
    assert figures["tok_s"] == 32.0 and figures["e2e_s"] == 2.0  # 64, 32 and 16 tok/s: the middle one
    assert figures["repeats_tok_s"] == [32.0, 64.0, 16.0] and figures["num_repeats"] == 3
    assert figures["decode_tok_s"] == 63 / 1.9
    failed = single_stream.median_figures([{"num_tokens": 0, "e2e_s": None, "ttft_ms": None, "tok_s": None,
                                            "decode_tok_s": None}])
    assert failed["tok_s"] is None and failed["repeats_tok_s"] == []


def test_report_shows_the_single_stream_and_the_scheduler_check():
    clock = FakeClock()
    run = openvino_peer.summarize_level(make_loop(FakePipeline(clock), clock).run(make_requests([2, 2]), 2))
    server = {"name": "openvino-int8", "note": "OpenVINO", "scenarios": [run["summary"]],
              "single_stream": {"num_tokens": 64, "e2e_s": 2.0, "ttft_ms": 40.0, "tok_s": 32.0, "decode_tok_s": 32.6},
              "info": {"max_num_seqs_probe": [
                  {"dynamic_split_fuse": True, "max_num_seqs": 2, "concurrency": 4, "max_num_scheduled": 4,
                   "is_in_force": False}]}}
    rows = report.serving_rows({"servers": [server]})
    assert rows[0][0] == "openvino-int8" and rows[0][-1].endswith("peak 2 scheduled, mean 2.0 over 2 steps")
    assert report.single_stream_rows({"servers": [server]}) == [["openvino-int8", "64", "32.0", "32.6", "40"]]
    assert report.max_num_seqs_lines({"servers": [server]}) == [
        "openvino-int8: max_num_seqs 2 at c=4, dynamic split-fuse on: peak 4 scheduled (NOT in force)"]


def test_openvino_peer_spec_is_pinned_and_keeps_the_cpu_torch():
    spec = peers.PEERS["openvino"]
    packages = [p for step in spec.packages for p in step]
    assert all("==" in p for p in packages)
    assert {p.split("==")[0].split("[")[0] for p in packages} == {
        "torch", "openvino", "openvino-tokenizers", "openvino-genai", "optimum-intel"}
    assert all(p == peers.TORCH for p in packages if p.startswith("torch"))
    assert spec.packages[-1][-1] == peers.TORCH and spec.uninstall == ("torchvision",)


def test_install_stamp_includes_the_uninstall_step(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path)
    peers.venv_dir("openvino").mkdir()
    stamp = peers.venv_dir("openvino") / ".installed.json"
    spec = peers.PEERS["openvino"]
    stamp.write_text(json.dumps({"packages": [list(p) for p in spec.packages]}))
    assert not peers.is_installed("openvino")  # installed before the uninstall step existed: redo it
    stamp.write_text(json.dumps({"packages": [list(p) for p in spec.packages] + [["uninstall", "torchvision"]]}))
    assert peers.is_installed("openvino")


@pytest.mark.parametrize("has_bf16, dtype", [(True, "bfloat16"), (False, "float32")])
def test_transformers_serve_dtype_follows_the_cpu(monkeypatch, has_bf16, dtype):
    import services.worker.config as worker_config
    from benchmarks.servers import transformers_serve_dtype

    monkeypatch.setattr(worker_config, "cpu_has_native_bf16", lambda: has_bf16)
    assert transformers_serve_dtype() == dtype
