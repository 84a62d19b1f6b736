"""Scenario repeats folded into one summary (medians), the raw latencies kept for plots, and the
harness's log line."""
from __future__ import annotations

import statistics
import time

SUMMARY_KEYS_MEDIAN = ("request_throughput", "output_throughput", "duration_s", "total_output_tokens")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def median_of_repeats(runs: list[dict]) -> dict:
    """One scenario summary from repeats: throughputs and every latency percentile by median."""
    summaries = [r["summary"] for r in runs]
    merged = dict(summaries[len(summaries) // 2])
    for key in SUMMARY_KEYS_MEDIAN:
        merged[key] = statistics.median(s[key] for s in summaries)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        merged[key] = {p: (statistics.median(v) if (v := [s[key][p] for s in summaries if s[key][p] is not None])
                           else None) for p in summaries[0][key]}
    for key in ("num_complete", "num_failed", "num_cancelled", "num_planned"):
        merged[key] = min(s[key] for s in summaries) if key == "num_complete" else max(s[key] for s in summaries)
    merged["is_truncated"] = any(s["is_truncated"] for s in summaries)
    if all(s.get("loadavg_1m") for s in summaries):  # the range over the repeats
        merged["loadavg_1m"] = [min(s["loadavg_1m"][0] for s in summaries), max(s["loadavg_1m"][1] for s in summaries)]
    merged["num_repeats"] = len(runs)
    merged["repeats"] = summaries
    return merged


def latency_lists(run: dict) -> dict[str, list[float]]:
    """The last repeat's raw latencies in ms, for the CDF plots."""
    requests = run["requests"]
    return {
        "ttft_ms": [r["ttft_s"] * 1e3 for r in requests if r["ttft_s"] is not None],
        "e2e_ms": [r["e2e_s"] * 1e3 for r in requests if r["complete"]],
        "itl_ms": [x * 1e3 for r in requests for x in r["itls_s"]],
    }
