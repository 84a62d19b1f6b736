"""benchmarks.merge: several runs of the same command become one result of medians."""
from __future__ import annotations

from benchmarks import merge, report


def _scenario(concurrency: int, tok_s: float, itl_ms: float) -> dict:
    percentiles = lambda v: {"mean": v, "p50": v, "p90": v, "p99": v}  # noqa: E731
    return {"mode": "concurrency", "concurrency": concurrency, "rate": None, "request_throughput": tok_s / 100,
            "output_throughput": tok_s, "duration_s": 10.0, "total_output_tokens": tok_s * 10,
            "ttft_ms": percentiles(100.0), "itl_ms": percentiles(itl_ms), "tpot_ms": percentiles(itl_ms),
            "e2e_ms": percentiles(1000.0), "num_complete": 4, "num_failed": 0, "num_cancelled": 0,
            "num_planned": 4, "is_truncated": False, "loadavg_1m": [1.0, 1.5]}


def _run(spindle_tok_s: float, llama_tok_s: float, step_ms: float, speedup: float) -> dict:
    overhead_row = {"num_running": 256, "steps_per_s": 1e3 / step_ms, "step_ms": step_ms, "tokens_per_s": 1.0,
                    "scheduling_ms": 1.0, "serialization_ms": 1.0,
                    "cpu_ms_per_step": {"frontend": 1.0, "scheduler": 2.0, "worker": 1.0}}
    side = lambda ms: {"ttft_ms": [ms], "ttft_ms_median": ms}  # noqa: E731
    return {
        "workload_note": "test", "spindle_reference": "spindle",
        "machine": {"loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.0, 1.0], "cpus": 2},
        "servers": [
            {"name": "spindle", "note": "", "scenarios": [_scenario(1, spindle_tok_s / 4, 50.0),
                                                          _scenario(32, spindle_tok_s, 200.0)],
             "latencies": {"c=1": {"ttft_ms": [1.0], "e2e_ms": [2.0], "itl_ms": [50.0]}}},
            {"name": "llama-cpp", "note": "", "scenarios": [_scenario(1, llama_tok_s, 30.0),
                                                            _scenario(32, llama_tok_s, 30.0)],
             "latencies": {}},
        ],
        "engine_overhead": {"rows": [overhead_row], "window_s": 2.0, "num_windows": 3},
        "prefix_cache": {"prefix_tokens": 1000, "num_requests": 2, "on": side(100.0), "off": side(100.0 * speedup),
                         "ttft_speedup": speedup},
    }


def test_every_figure_is_the_median_of_the_runs():
    runs = [_run(90.0, 20.0, 5.0, 30.0), _run(60.0, 25.0, 9.0, 10.0), _run(80.0, 30.0, 6.0, 20.0)]
    result = merge.merge(runs)
    spindle, llama = result["servers"]
    c32 = next(s for s in spindle["scenarios"] if s["concurrency"] == 32)
    assert c32["output_throughput"] == 80.0 and c32["num_repeats"] == 3
    assert [s["output_throughput"] for s in llama["scenarios"]] == [25.0, 25.0]
    assert spindle["latencies"]["c=1"]["itl_ms"] == [50.0, 50.0, 50.0]  # pooled for the CDFs
    assert result["engine_overhead"]["rows"][0]["step_ms"] == 6.0
    assert result["engine_overhead"]["rows"][0]["step_ms_runs"] == [5.0, 9.0, 6.0]
    assert result["prefix_cache"]["ttft_speedup"] == 20.0
    assert result["machine"]["loadavg_after"][0] == 2.0
    assert "3.20x (80.0 vs 25.0 tok/s)" in report.render(result)


def test_a_server_missing_from_a_run_is_marked_not_merged():
    partial = _run(80.0, 20.0, 5.0, 30.0)
    partial["servers"] = partial["servers"][:1]
    result = merge.merge([_run(90.0, 20.0, 5.0, 30.0), partial])
    assert result["servers"][1]["skip_reason"] == "not in every run"
