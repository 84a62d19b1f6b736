"""The benchmark harness end to end, small: the load generator against a fake-model cluster.

Four streamed chat requests through the real frontend and scheduler, a worker with `--fake-model`
(no weights, fixed tokens at once); checks the summary and table the harness writes, and that
every response came back complete with exactly max_tokens tokens.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import report
from benchmarks.loadgen import Target, run_scenario
from benchmarks.repeats import median_of_repeats
from benchmarks.workload import WorkloadSpec, build_workload, load_default_tokenizer
from tests.e2e.cluster import SpindleCluster

SUMMARY_KEYS = {"num_planned", "num_complete", "num_failed", "num_cancelled", "is_all_complete", "duration_s",
                "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
                "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "mode", "concurrency", "rate", "is_truncated"}


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    cluster = SpindleCluster(tmp_path_factory.mktemp("bench"), env={"SPINDLE_FAKE_MODEL": "true"},
                             attention_backend="none")
    try:
        yield cluster.start(timeout_s=120)
    finally:
        cluster.stop()


def test_load_generator_against_fake_worker(fake_cluster):
    tokenizer = load_default_tokenizer()
    requests = build_workload(WorkloadSpec(num_requests=4, seed=3, max_output_tokens=48), tokenizer)
    target = Target(fake_cluster.base_url, "SmolLM2-135M-Instruct", {"ignore_eos": True})

    run = asyncio.run(run_scenario(target, requests, tokenizer, concurrency=2, time_limit_s=60))

    summary = run["summary"]
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["is_all_complete"] and summary["num_complete"] == 4 and summary["num_failed"] == 0
    assert not summary["is_truncated"]
    assert summary["total_output_tokens"] == sum(r.max_tokens for r in requests)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < summary[key]["p50"] <= summary[key]["p99"]
    assert summary["output_throughput"] > 0 and summary["request_throughput"] > 0
    for row, req in zip(run["requests"], requests):
        assert row["complete"] and row["saw_done"] and row["finish_reason"] == "length"
        assert row["output_tokens"] == row["usage_tokens"] == req.max_tokens
        assert len(row["itls_s"]) == req.max_tokens - 1  # Spindle streams one token per chunk

    rate_run = asyncio.run(run_scenario(target, requests, tokenizer, rate=50.0, seed=1, time_limit_s=60))
    assert rate_run["summary"]["is_all_complete"] and rate_run["summary"]["mode"] == "rate"

    scenario = median_of_repeats([run])
    result = {
        "workload_note": "smoke", "spindle_reference": "spindle",
        "machine": {"loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [1.0, 1.0, 1.0], "cpus": 2},
        "servers": [{"name": "spindle", "note": "fake model", "scenarios": [scenario]},
                    {"name": "llama-cpp", "skip_reason": "not installed", "scenarios": []}],
    }
    json.dumps(result)  # what benchmarks/results/*.json holds must serialise
    text = report.render(result)
    assert "| spindle " in text and "c=2" in text and "4/4" in text
    assert "skipped: not installed" in text
    assert text.strip().splitlines()[-1].startswith("| single-stream decode tok/s vs llama.cpp")
