"""Tables and goal checks from a harness result (the dict `benchmarks.run` writes as JSON)."""
from __future__ import annotations

GOAL_RATIO = 3.0
GOAL_TOK_S_AT_64 = 1000.0
GOAL_OVERHEAD_MS = 1.0
GOAL_OVERHEAD_SHARE = 0.05
GOAL_PREFIX_SPEEDUP = 5.0
GOAL_LLAMA_SINGLE_STREAM = 1.5
MIN_PEER_TOKENS = 50  # a throughput ratio against a peer that made fewer tokens than this means nothing


def _fmt(value, spec: str = ".0f", none: str = "-", unit: str = "") -> str:
    return none if value is None else format(value, spec) + unit


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def scenario_label(s: dict) -> str:
    return f"c={s['concurrency']}" if s["mode"] == "concurrency" else f"rate={s['rate']:g}/s"


def serving_rows(result: dict) -> list[list[str]]:
    rows = []
    for server in result["servers"]:
        if server.get("skip_reason"):
            rows.append([server["name"], "-", *["-"] * 8, f"skipped: {server['skip_reason']}"])
            continue
        for s in server["scenarios"]:
            note = server.get("note", "")
            if s.get("is_truncated"):
                note = (note + "; " if note else "") + f"cut at {s['time_limit_s']:.0f} s"
            if s.get("num_repeats", 1) > 1:
                note = (note + "; " if note else "") + f"median of {s['num_repeats']}"
            if s.get("scheduler"):  # an in-process peer: what its pipeline scheduled, measured per step
                note = (note + "; " if note else "") + scheduled_note(s["scheduler"])
            rows.append([
                server["name"], scenario_label(s), _fmt(s["request_throughput"], ".2f"),
                _fmt(s["output_throughput"], ".1f"),
                f"{_fmt(s['ttft_ms']['p50'])} / {_fmt(s['ttft_ms']['p99'])}",
                f"{_fmt(s['itl_ms']['p50'], '.1f')} / {_fmt(s['itl_ms']['p99'], '.1f')}",
                f"{_fmt(s['e2e_ms']['p50'])} / {_fmt(s['e2e_ms']['p99'])}",
                f"{s['num_complete']}/{s['num_planned']}",
                str(s["num_failed"]),
                "{:.1f}-{:.1f}".format(*s["loadavg_1m"]) if s.get("loadavg_1m") else "-",
                note,
            ])
    return rows


def scheduled_note(steps: dict) -> str:
    return (f"peak {steps['max_num_scheduled']} scheduled, mean {steps['mean_num_scheduled']:.1f} over "
            f"{steps['num_steps']} steps")


def single_stream_rows(result: dict) -> list[list[str]]:
    rows = []
    for server in result["servers"]:
        if (single := server.get("single_stream")) and not server.get("skip_reason"):
            rows.append([server["name"], str(single["num_tokens"]), _fmt(single["tok_s"], ".1f"),
                         _fmt(single["decode_tok_s"], ".1f"), _fmt(single["ttft_ms"])])
    return rows


SINGLE_STREAM_HEADERS = ["server", "tokens", "tok/s", "decode tok/s (after the first)", "TTFT ms"]


def max_num_seqs_lines(result: dict) -> list[str]:
    """What the OpenVINO probe found: whether max_num_seqs bounded the scheduled requests, per mode."""
    lines = []
    for server in result["servers"]:
        for p in (server.get("info") or {}).get("max_num_seqs_probe") or []:
            lines.append(f"{server['name']}: max_num_seqs {p['max_num_seqs']} at c={p['concurrency']}, dynamic "
                         f"split-fuse {'on' if p['dynamic_split_fuse'] else 'off'}: peak {p['max_num_scheduled']} "
                         f"scheduled ({'in force' if p['is_in_force'] else 'NOT in force'})")
    return lines


SERVING_HEADERS = ["server", "scenario", "req/s", "out tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms",
                   "E2E p50/p99 ms", "complete", "failed", "load 1m", "note"]


def overhead_rows(result: dict) -> list[list[str]]:
    rows = []
    for r in (result.get("engine_overhead") or {}).get("rows", []):
        cpu = r["cpu_ms_per_step"]
        rows.append([str(r["num_running"]), _fmt(r["steps_per_s"], ".1f"), _fmt(r["step_ms"], ".2f"),
                     _fmt(r["scheduling_ms"], ".2f"), _fmt(r["serialization_ms"], ".2f"),
                     " / ".join(_fmt(cpu.get(k), ".2f") for k in ("frontend", "scheduler", "worker"))])
    return rows


OVERHEAD_HEADERS = ["running", "steps/s", "ms/step (served)", "scheduling ms (in-process)",
                    "serialization ms (in-process)", "CPU ms/step frontend/scheduler/worker"]


def _scenario(result: dict, server_name: str, concurrency: int) -> dict | None:
    for server in result["servers"]:
        if server["name"] == server_name and not server.get("skip_reason"):
            for s in server["scenarios"]:
                if s["mode"] == "concurrency" and s["concurrency"] == concurrency:
                    return s
    return None


def _decode_tok_s(s: dict | None) -> float | None:
    """Single-stream decode speed: 1 / median inter-token latency (counted on requests cut by the
    time limit too, so a slow server still gets a figure)."""
    return 1e3 / s["itl_ms"]["p50"] if s and s["itl_ms"]["p50"] else None


def _status(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def goal_rows(result: dict, spindle: str = "spindle") -> list[list[str]]:
    rows = []
    for c in (32, 64):
        ours = _scenario(result, spindle, c)
        for peer, label in (("transformers-serve", "transformers serve CB"), ("llama-cpp", "llama.cpp server")):
            theirs = _scenario(result, peer, c)
            ratio = (ours["output_throughput"] / theirs["output_throughput"]
                     if ours and theirs and theirs["output_throughput"] else None)
            measured = _fmt(ratio, ".2f", "n/a", "x")
            if ours and theirs and theirs["total_output_tokens"] < MIN_PEER_TOKENS:
                ratio, measured = None, f"n/a ({label} made {theirs['total_output_tokens']:.0f} token(s) in the limit)"
            elif ours and theirs:
                measured += f" ({ours['output_throughput']:.1f} vs {theirs['output_throughput']:.1f} tok/s)"
            rows.append([f"output tok/s at c={c} vs {label}", measured,
                         f">= {GOAL_RATIO:g}x", _status(None if ratio is None else ratio >= GOAL_RATIO)])
    ours64 = _scenario(result, spindle, 64)
    tok_s = ours64["output_throughput"] if ours64 else None
    rows.append(["output tok/s at c=64", _fmt(tok_s, ".1f", "n/a"), f">= {GOAL_TOK_S_AT_64:g}",
                 _status(None if tok_s is None else tok_s >= GOAL_TOK_S_AT_64)])
    overhead = next((r for r in (result.get("engine_overhead") or {}).get("rows", []) if r["num_running"] == 256), None)
    ms = overhead["step_ms"] if overhead else None
    rows.append(["engine overhead per step, 256 running", _fmt(ms, ".2f", "n/a", " ms"), f"< {GOAL_OVERHEAD_MS:g} ms",
                 _status(None if ms is None else ms < GOAL_OVERHEAD_MS)])
    model_ms = (result.get("model_step_256") or {}).get("decode_step_ms")
    share = ms / (ms + model_ms) if ms is not None and model_ms else None
    rows.append(["engine overhead share of a 256-request step", _fmt(share and share * 100, ".1f", "n/a", " %")
                 + (f" (model step {model_ms:.0f} ms)" if model_ms else ""),
                 f"< {GOAL_OVERHEAD_SHARE * 100:g} %", _status(None if share is None else share < GOAL_OVERHEAD_SHARE)])
    speedup = (result.get("prefix_cache") or {}).get("ttft_speedup")
    rows.append(["prefix-cache TTFT, off / on", _fmt(speedup, ".1f", "n/a", "x"), f">= {GOAL_PREFIX_SPEEDUP:g}x",
                 _status(None if speedup is None else speedup >= GOAL_PREFIX_SPEEDUP)])
    ours1, hf1, llama1 = (_decode_tok_s(_scenario(result, n, 1)) for n in (spindle, "hf-generate", "llama-cpp"))
    rows.append(["single-stream decode tok/s vs HF generate batch 1",
                 f"{_fmt(ours1, '.1f', 'n/a')} vs {_fmt(hf1, '.1f', 'n/a')}", ">= HF",
                 _status(None if ours1 is None or hf1 is None else ours1 >= hf1)])
    rows.append(["single-stream decode tok/s vs llama.cpp (Q4_1)",
                 f"{_fmt(ours1, '.1f', 'n/a')} vs {_fmt(llama1, '.1f', 'n/a')}", f">= llama.cpp / {GOAL_LLAMA_SINGLE_STREAM:g}",
                 _status(None if ours1 is None or llama1 is None else ours1 * GOAL_LLAMA_SINGLE_STREAM >= llama1)])
    return rows


GOAL_HEADERS = ["goal", "measured", "target", "status"]


def render(result: dict) -> str:
    parts = [f"Online serving ({result['workload_note']})", table(SERVING_HEADERS, serving_rows(result))]
    if rows := single_stream_rows(result):
        parts += ["", "Single stream (one request, greedy, EOS ignored)", table(SINGLE_STREAM_HEADERS, rows)]
    if lines := max_num_seqs_lines(result):
        parts += ["", "OpenVINO scheduler check (max_num_seqs against the requests scheduled per step)", *lines]
    if result.get("engine_overhead"):
        parts += ["", "Engine overhead (fake-model worker: a step's time is all overhead)",
                  table(OVERHEAD_HEADERS, overhead_rows(result))]
    if result.get("prefix_cache"):
        p = result["prefix_cache"]
        parts += ["", f"Prefix cache: {p['prefix_tokens']}-token shared prefix, {p['num_requests']} requests at c=1: "
                      f"TTFT median on {_fmt(p['on']['ttft_ms_median'])} ms, off {_fmt(p['off']['ttft_ms_median'])} ms"]
    from benchmarks import cpu_goals  # it builds on this module's helpers

    if cpu := cpu_goals.render(result):
        parts += ["", cpu]
    load = result["machine"]
    reference = result.get("spindle_reference", "spindle")
    # Every Spindle configuration that served gets its own goal table (the reference one first).
    variants = [reference] + [s["name"] for s in result["servers"] if s["name"].startswith("spindle-")
                              and s["name"] not in (reference, "spindle-fake") and not s.get("skip_reason")]
    for name in variants:
        parts += ["", f"Goals (Spindle = '{name}'; load average {load['loadavg_before'][0]:.2f} before, "
                      f"{load['loadavg_after'][0]:.2f} after, {load['cpus']} CPUs)",
                  table(GOAL_HEADERS, goal_rows(result, name))]
    return "\n".join(parts)
