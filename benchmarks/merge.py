"""Several harness runs as one result: every figure the median over the runs.

    .venv/bin/python -m benchmarks.merge OUT.json RUN1.json RUN2.json [RUN3.json ...]

The runs must come from the same command (same seed, so every server got the same requests in
each run). Each scenario becomes the median of its runs (as `--repeats` does inside one run), the
engine-overhead rows and prefix-cache TTFTs the medians of theirs; latency samples for the CDF
plots are pooled. Prints the tables and draws the plots beside OUT.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks import report
from benchmarks.repeats import median_of_repeats


def _scenario_key(s: dict) -> tuple:
    return s["mode"], s.get("concurrency"), s.get("rate")


def merge_servers(runs: list[dict]) -> list[dict]:
    merged = []
    for first in runs[0]["servers"]:
        same = [s for run in runs for s in run["servers"] if s["name"] == first["name"] and not s.get("skip_reason")]
        if len(same) < len(runs):
            merged.append(first if first.get("skip_reason") else {**first, "skip_reason": "not in every run"})
            continue
        scenarios = []
        for scenario in first["scenarios"]:
            matching = [s for server in same for s in server["scenarios"]
                        if _scenario_key(s) == _scenario_key(scenario)]
            scenarios.append(median_of_repeats([{"summary": s} for s in matching]))
        latencies: dict = {}
        for server in same:
            for label, lists in server.get("latencies", {}).items():
                pooled = latencies.setdefault(label, {k: [] for k in lists})
                for key, values in lists.items():
                    pooled[key] += values
        merged.append({**first, "scenarios": scenarios, "latencies": latencies})
    return merged


def merge_overhead(runs: list[dict]) -> dict | None:
    tables = [run["engine_overhead"] for run in runs if run.get("engine_overhead")]
    if not tables:
        return None
    rows = []
    for row in tables[0]["rows"]:
        same = [r for t in tables for r in t["rows"] if r["num_running"] == row["num_running"]]
        merged = dict(row)
        for key in ("steps_per_s", "step_ms", "tokens_per_s", "scheduling_ms", "serialization_ms"):
            merged[key] = statistics.median(r[key] for r in same)
        merged["cpu_ms_per_step"] = {k: statistics.median(r["cpu_ms_per_step"][k] for r in same)
                                     for k in row["cpu_ms_per_step"]}
        merged["step_ms_runs"] = [r["step_ms"] for r in same]
        rows.append(merged)
    return {**tables[0], "rows": rows}


def merge_prefix(runs: list[dict]) -> dict | None:
    found = [run["prefix_cache"] for run in runs if run.get("prefix_cache")]
    if not found:
        return None
    merged = dict(found[0])
    for side in ("on", "off"):
        merged[side] = {**found[0][side], "ttft_ms": [x for p in found for x in p[side]["ttft_ms"]],
                        "ttft_ms_median": statistics.median(p[side]["ttft_ms_median"] for p in found)}
    merged["ttft_speedup"] = statistics.median(p["ttft_speedup"] for p in found)
    merged["ttft_speedup_runs"] = [p["ttft_speedup"] for p in found]
    return merged


def merge(runs: list[dict]) -> dict:
    machine = dict(runs[0]["machine"])
    machine["loadavg_before"] = min((r["machine"]["loadavg_before"] for r in runs), key=lambda x: x[0])
    machine["loadavg_after"] = max((r["machine"]["loadavg_after"] for r in runs), key=lambda x: x[0])
    result = {**runs[0], "machine": machine, "servers": merge_servers(runs),
              "workload_note": runs[0]["workload_note"] + f"; median of {len(runs)} runs",
              "engine_overhead": merge_overhead(runs), "prefix_cache": merge_prefix(runs),
              "num_runs": len(runs), "wall_s": sum(r.get("wall_s", 0) for r in runs)}
    steps = [r["model_step_256"] for r in runs if r.get("model_step_256")]
    if steps:
        result["model_step_256"] = {**steps[0], "decode_step_ms": statistics.median(s["decode_step_ms"] for s in steps)}
    return result


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        raise SystemExit(__doc__)
    out, paths = Path(args[0]), args[1:]
    result = merge([json.loads(Path(p).read_text()) for p in paths])
    result["merged_from"] = paths
    out.write_text(json.dumps(result, indent=1))
    try:
        from benchmarks import plots

        result["plots"] = plots.write_plots(result, out.with_suffix(""))
    except ImportError:
        result["plots"] = []
    print(report.render(result))
    return result


if __name__ == "__main__":
    main()
