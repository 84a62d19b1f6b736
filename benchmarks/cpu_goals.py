"""The CPU table of a harness result: every server's output tok/s at each concurrency level with
its single-stream row, the machine's floors, and the goals against OpenVINO GenAI and transformers
serve (same run, same requests, ratios)."""
from __future__ import annotations

import re

from benchmarks.report import MIN_PEER_TOKENS, _fmt, _scenario, _status, table

LEVELS = (1, 8, 32, 64)
GOAL_SINGLE_STREAM = 1.0  # at least the peer's figure
GOAL_FLOOR = 1.3  # a decode step within this of weight bytes / read bandwidth
GOAL_BATCH = 1.5  # against OpenVINO GenAI's continuous-batching pipeline
GOAL_TRANSFORMERS = 3.0
GOAL_OVERHEAD_MS = 1.0


# Each Spindle variant against the OpenVINO row of its weights (the weight-bytes floor's kind);
# OpenVINO's CPU plugin keeps an 8-bit (u8) KV cache in both of its rows, and in its int8 row quantizes
# activations to int8 too (its dynamic quantization default): W8A8 is that row's like in configuration.
PAIRS = (("spindle-bf16", "openvino-bf16", "bfloat16"), ("spindle-bf16-kv8", "openvino-bf16", "bfloat16"),
         ("spindle-int8", "openvino-int8", "int8"), ("spindle-int8-kv8", "openvino-int8", "int8"),
         ("spindle-w8a8", "openvino-int8", "int8"), ("spindle-w8a8-kv8", "openvino-int8", "int8"),
         ("spindle-w8a8-rows", "openvino-int8", "int8"))
# In accuracy, on 32 chat prompts against float32 (benchmarks.engine_drift, Zen 4, docs/benchmarks.md),
# tokens kept of 64 greedy: OpenVINO's int8 20.9 (asymmetric per-channel weights, activations with a
# scale per 32 values); Spindle's W8A8 as OpenVINO's (the default on the int8 tiles) 22.0-22.2, with
# one activation scale per row and symmetric weights (spindle-w8a8-rows) 9.9-11.8; Spindle's bf16 with
# the int8 cache 30.5. Goal 2's rows say which kind of pair they are, and a row at least as accurate
# as OpenVINO's int8 is added.
BATCH_PAIR_NOTES = {("spindle-w8a8", "openvino-int8"): "like configuration and accuracy",
                    ("spindle-w8a8-kv8", "openvino-int8"): "like configuration and accuracy",
                    ("spindle-w8a8-rows", "openvino-int8"): "like configuration, not accuracy",
                    ("spindle-bf16-kv8", "openvino-int8"): "like accuracy"}
ACCURACY_PAIRS = (("spindle-bf16-kv8", "openvino-int8"),)


# A row served with --stream-interval N (server_catalog: the row's name, then -siN).
STREAM_INTERVAL_ROW = re.compile(r"(spindle.*)-si(\d+)")


def _pairs(result: dict) -> list[tuple[str, str, str]]:
    """The PAIRS whose Spindle row ran (the bf16 and int8 ones always listed, as n/a if absent), each
    followed by the same row with a stream interval where that ran too."""
    names = [s["name"] for s in result["servers"]]
    pairs = []
    for ours, theirs, kind in PAIRS:
        if ours in names or ours in ("spindle-bf16", "spindle-int8"):
            pairs.append((ours, theirs, kind))
        pairs += [(name, theirs, kind) for name in names
                  if (m := STREAM_INTERVAL_ROW.fullmatch(name)) and m.group(1) == ours]
    return pairs


def _pair_note(ours: str, theirs: str) -> str | None:
    m = STREAM_INTERVAL_ROW.fullmatch(ours)
    if m is None:
        return BATCH_PAIR_NOTES.get((ours, theirs))
    base = BATCH_PAIR_NOTES.get((m.group(1), theirs))
    return (base + ", " if base else "") + f"streamed every {m.group(2)} tokens"


def _single(result: dict, name: str) -> dict | None:
    server = next((s for s in result["servers"] if s["name"] == name and not s.get("skip_reason")), None)
    return server.get("single_stream") if server else None


def matrix_rows(result: dict) -> list[list[str]]:
    rows = []
    for server in result["servers"]:
        if server.get("skip_reason") or server["name"] == "spindle-fake":
            continue
        cells = [_fmt((s := _scenario(result, server["name"], c)) and s["output_throughput"], ".1f") for c in LEVELS]
        single = server.get("single_stream") or {}
        rows.append([server["name"], *cells, _fmt(single.get("tok_s"), ".1f"), _fmt(single.get("decode_tok_s"), ".1f")])
    return rows


MATRIX_HEADERS = ["server", *(f"c={c} out tok/s" for c in LEVELS), "single stream tok/s", "decode tok/s"]


def _ratio_row(label: str, ours: float | None, theirs: float | None, goal: float, unit: str = "tok/s") -> list[str]:
    ratio = ours / theirs if ours and theirs else None
    measured = _fmt(ratio, ".2f", "n/a", "x") + (f" ({ours:.1f} vs {theirs:.1f} {unit})" if ratio else "")
    return [label, measured, f">= {goal:g}x", _status(None if ratio is None else ratio >= goal)]


def _throughput(result: dict, name: str, c: int) -> float | None:
    """None also for a row with fewer than MIN_PEER_TOKENS tokens: a ratio against it means nothing."""
    s = _scenario(result, name, c)
    return s["output_throughput"] if s and s["total_output_tokens"] >= MIN_PEER_TOKENS else None


def goal_rows(result: dict) -> list[list[str]]:
    rows = []
    floors = result["machine"].get("floors") or {}
    weight_bytes = floors.get("model_weight_bytes") or {}
    for ours, theirs, kind in _pairs(result):
        mine, peer = _single(result, ours), _single(result, theirs)
        rows.append(_ratio_row(f"1. single stream, {ours} vs {theirs}", mine and mine["tok_s"],
                               peer and peer["tok_s"], GOAL_SINGLE_STREAM))
        floor_ms = weight_bytes.get(kind) / (floors["read_gb_s"] * 1e9) * 1e3 \
            if weight_bytes.get(kind) and floors.get("read_gb_s") else None
        step_ms = 1e3 / mine["decode_tok_s"] if mine and mine.get("decode_tok_s") else None
        over = step_ms / floor_ms if step_ms and floor_ms else None
        rows.append([f"1. {ours} decode step against the floor (weight bytes / read bandwidth)",
                     _fmt(over, ".2f", "n/a", "x") + (f" ({step_ms:.1f} vs {floor_ms:.1f} ms)" if over else ""),
                     f"<= {GOAL_FLOOR:g}x", _status(None if over is None else over <= GOAL_FLOOR)])
    names = {s["name"] for s in result["servers"]}
    batch_pairs = [(ours, theirs) for ours, theirs, _ in _pairs(result)]
    batch_pairs += [pair for pair in ACCURACY_PAIRS if pair[0] in names]
    for c in (32, 64):
        for ours, theirs in batch_pairs:
            note = _pair_note(ours, theirs)
            rows.append(_ratio_row(f"2. c={c}, {ours} vs {theirs}" + (f" ({note})" if note else ""),
                                   _throughput(result, ours, c), _throughput(result, theirs, c), GOAL_BATCH))
    for c in (32, 64):
        rows.append(_ratio_row(f"3. c={c}, spindle-bf16 vs transformers serve", _throughput(result, "spindle-bf16", c),
                               _throughput(result, "transformers-serve", c), GOAL_TRANSFORMERS))
    overhead = next((r for r in (result.get("engine_overhead") or {}).get("rows", []) if r["num_running"] == 256), None)
    ms = overhead["step_ms"] if overhead else None
    rows.append(["3. engine overhead per step, 256 running", _fmt(ms, ".2f", "n/a", " ms"),
                 f"< {GOAL_OVERHEAD_MS:g} ms", _status(None if ms is None else ms < GOAL_OVERHEAD_MS)])
    return rows


def floors_line(result: dict) -> str:
    floors = result["machine"].get("floors")
    if not floors:
        return ""
    rows, k, n = floors["matmul_shape"]
    gflops = ", ".join(f"{name} {value:.0f}" for name, value in floors["matmul_gflop_s"].items())
    return (f"Machine: flags {' '.join(floors['cpu_flags']) or 'none of interest'}; read {floors['read_gb_s']:.1f} GB/s; "
            f"matmul {rows}x{k}x{n} GFLOP/s: {gflops}")


def render(result: dict) -> str:
    if not any(s["name"].startswith("openvino-") or s["name"] in {p[0] for p in PAIRS} for s in result["servers"]):
        return ""
    parts = ["CPU engines: output tok/s by concurrency (medians of the repeats), single stream", table(
        MATRIX_HEADERS, matrix_rows(result))]
    if line := floors_line(result):
        parts.append(line)
    parts += ["", "CPU goals (same run, same requests)", table(["goal", "measured", "target", "status"],
                                                                goal_rows(result))]
    return "\n".join(parts)
