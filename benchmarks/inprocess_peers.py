"""The harness's peers that run in-process rather than behind HTTP: HF generate's static batches
(the project venv) and OpenVINO GenAI's ContinuousBatchingPipeline (its own venv), each driven by a
subprocess over the same requests; and the real model's step at 256 requests for the overhead share.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import openvino_peer, peers, report
from benchmarks.repeats import latency_lists, log, median_of_repeats
from benchmarks.server_catalog import model_folder
from benchmarks.servers import LOG_DIR, RESULTS_DIR, Server

ROOT = Path(__file__).resolve().parents[1]


def run_hf_generate(server: Server, requests, plan: list[dict], repeats: int, time_limit_s: float,
                    dtype: str) -> dict:
    out = {"name": server.name, "note": server.note, "skip_reason": "", "scenarios": [], "latencies": {}}
    levels = [p for p in plan if p.get("concurrency") and p["concurrency"] <= (server.max_concurrency or 10**9)]
    RESULTS_DIR.mkdir(exist_ok=True)
    workload_path = RESULTS_DIR / "workload.json"
    workload_path.write_text(json.dumps([r.to_dict() for r in requests]))
    runs_by_level: list[list[dict]] = [[] for _ in levels]
    for repeat in range(repeats):
        out_path = RESULTS_DIR / "hf_generate_raw.json"
        command = [sys.executable, "-m", "benchmarks.hf_generate", "--workload", str(workload_path),
                   "--batch-sizes", ",".join(str(p["concurrency"]) for p in levels),
                   "--num-requests", ",".join(str(p["num_requests"]) for p in levels),
                   "--offsets", ",".join(str(p["offset"] + repeat * p["num_requests"]) for p in levels),
                   "--dtype", dtype, "--time-limit-s", str(time_limit_s), "--out", str(out_path)]
        log(f"hf-generate: {' '.join(command[2:])}")
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            out["skip_reason"] = f"failed: {done.stderr.strip()[-300:]}"
            return out
        for i, run in enumerate(json.loads(out_path.read_text())["runs"]):
            runs_by_level[i].append(run)
    for runs in runs_by_level:
        summary = median_of_repeats(runs)
        out["scenarios"].append(summary)
        out["latencies"][report.scenario_label(summary)] = latency_lists(runs[-1])
        log(f"hf-generate {report.scenario_label(summary)}: {summary['output_throughput']:.1f} out tok/s")
    return out


def run_openvino(server: Server, requests, tokenizer, plan: list[dict], repeats: int, time_limit_s: float,
                 single_stream_tokens: int) -> dict:
    """The OpenVINO GenAI driver in the peer's venv: closed loop at each concurrency level, no rates."""
    out = {"name": server.name, "note": server.note, "skip_reason": server.skip_reason, "scenarios": [],
           "latencies": {}, "info": server.info}
    if server.skip_reason:
        log(f"{server.name}: skipped: {server.skip_reason}")
        return out
    RESULTS_DIR.mkdir(exist_ok=True)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    workload_path, out_path = RESULTS_DIR / "openvino_workload.json", RESULTS_DIR / f"{server.name}_raw.json"
    workload_path.write_text(json.dumps(openvino_peer.driver_workload(requests, tokenizer, single_stream_tokens)))
    out_path.unlink(missing_ok=True)
    levels = openvino_peer.level_spec(plan, repeats)
    command = [str(peers.venv_python("openvino")), "-m", "benchmarks.openvino_peer", "--model-dir", model_folder(),
               "--variant", server.info["variant"], "--ir-root", str(peers.venv_dir("openvino") / "ir"),
               "--workload", str(workload_path), "--levels", levels, "--time-limit-s", str(time_limit_s),
               "--max-num-seqs", str(server.info["max_num_seqs"]), "--single-stream-repeats", str(repeats),
               "--out", str(out_path)]
    log(f"{server.name}: {' '.join(command[3:])}")
    log_path = LOG_DIR / f"{server.name}.log"
    with open(log_path, "ab") as driver_log:  # export (once), compile, then every level of every repeat
        try:
            returncode = subprocess.run(command, cwd=ROOT, stdout=driver_log, stderr=subprocess.STDOUT,
                                        timeout=1800 + time_limit_s * (levels.count(",") + 3)).returncode
        except subprocess.TimeoutExpired:
            returncode = -1
    if returncode != 0:
        tail = " / ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
        out["skip_reason"] = f"driver failed ({returncode}): {tail[-300:]} (log: {log_path})"
        log(f"{server.name}: {out['skip_reason']}")
        return out
    raw = json.loads(out_path.read_text())
    for runs in openvino_peer.group_levels(raw, plan, repeats):
        summary = median_of_repeats(runs)
        out["scenarios"].append(summary)
        out["latencies"][report.scenario_label(summary)] = latency_lists(runs[-1])
        log(f"{server.name} {report.scenario_label(summary)}: {summary['output_throughput']:.1f} out tok/s, "
            f"peak {summary['scheduler']['max_num_scheduled']} scheduled, {summary['num_complete']}/"
            f"{summary['num_planned']} complete")
    out["single_stream"] = raw.get("single_stream")
    out["note"] += f", {raw['kv_cache_precision']} KV cache (the CPU plugin's default)"
    group_size = raw.get("dynamic_quantization_group_size")
    if server.info["variant"] == "int8" and group_size:  # the plugin quantizes activations only for int8 weights
        out["note"] += f", activations quantized to int8 in groups of {group_size} (the plugin's default)"
    out["info"] |= {k: raw.get(k) for k in ("openvino", "openvino_genai", "settings", "kv_cache_precision",
                                             "dynamic_quantization_group_size",
                                             "export_s", "compile_s", "max_num_seqs_probe")} | {"log": str(log_path)}
    return out


def model_step_256(dtype: str) -> dict | None:
    """The real model's decode step at 256 requests (1-token prompts: contexts of a few tokens, so
    a lower bound on the step, which makes the overhead share an upper bound)."""
    path = RESULTS_DIR / "step_bench_256.json"
    command = [sys.executable, "-m", "benchmarks.step_bench", "--batch-sizes", "256", "--prompt-len", "1",
               "--decode-steps", "2", "--repeats", "1", "--dtype", dtype, "--out", str(path)]
    log("model step at 256 requests: " + " ".join(command[2:]))
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        log(f"model step at 256 failed: {done.stderr.strip()[-300:]}")
        return None
    return json.loads(path.read_text())["rows"][0]
