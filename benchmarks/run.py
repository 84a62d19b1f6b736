"""The benchmark harness (issue 8): Spindle and its peers on one workload, then engine overhead and
prefix caching; a table printed last, JSON and PNG plots under benchmarks/results/.

    .venv/bin/python -m benchmarks.run --quick     # c=1 and 8, few requests, one repeat (minutes)
    .venv/bin/python -m benchmarks.run             # c=1, 8, 32, 64 and Poisson rates, peers installed

Every server gets the same seeded requests (benchmarks/workload.py) at each load; each is started
on loopback by the harness and stopped after its scenarios; a peer that cannot be installed or
started gets a row that says why. Scenarios have a time limit (open requests are then cancelled and
the row says "cut"), so one slow server cannot hold the run hostage.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import openvino_peer, peers, report
from benchmarks.loadgen import run_scenario
from benchmarks.servers import (LOG_DIR, RESULTS_DIR, ProcessServer, Server, SpindleServer, free_port,
                               transformers_serve_dtype)
from benchmarks.workload import (ChatRequest, WorkloadSpec, build_workload, count_prompt_tokens,
                                load_default_tokenizer)

ROOT = Path(__file__).resolve().parents[1]
SETTLE_S = 3.0
SUMMARY_KEYS_MEDIAN = ("request_throughput", "output_throughput", "duration_s", "total_output_tokens")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "has_avx512": "avx512f" in flags, "has_amx": "amx_tile" in flags, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "git_commit": commit,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "loadavg_before": list(os.getloadavg())}


# --- servers ------------------------------------------------------------------------------------
def model_folder() -> str:
    from services.common.model_files import resolve_model

    return str(resolve_model(None, None).path)


def gguf_path() -> str:
    from services.common.model_files import embedded_gguf_path

    return str(embedded_gguf_path())


def transformers_serve(dtype: str) -> Server:
    """`dtype` auto: the faster of bfloat16 and float32 on this CPU (servers.transformers_serve_dtype)."""
    is_auto, dtype = dtype == "auto", transformers_serve_dtype() if dtype == "auto" else dtype
    path = model_folder()
    command = [str(peers.venv_dir("transformers-serve") / "bin" / "transformers"), "serve", "--continuous-batching",
               "--host", "127.0.0.1", "--port", str(port := free_port()), "--dtype", dtype, "--device", "cpu",
               "--log-level", "warning", path]
    # It refuses stream_options and ignores logit_bias under continuous batching, but takes a
    # per-request generation config: an EOS id outside the vocabulary forces max_tokens tokens.
    force = {"generation_config": json.dumps({"do_sample": False, "eos_token_id": 10**6}), "stream_options": None}
    return ProcessServer("transformers-serve", command, port, path, force, forces_length=True,
                         note=f"transformers {peers.installed_version('transformers-serve')}, {dtype}"
                              + (" (auto: the faster dtype on this CPU)" if is_auto else ""))


def llama_cpp_server() -> Server:
    port = free_port()
    command = [str(peers.venv_python("llama-cpp")), str(Path(__file__).parent / "llama_cpp_launcher.py"),
               "--model", gguf_path(), "--port", str(port), "--n-ctx", "8192"]
    return ProcessServer("llama-cpp", command, port, "SmolLM2-135M-Instruct",
                         {"logit_bias": {"2": -100.0}, "stream_options": None}, forces_length=True,
                         note=f"llama-cpp-python {peers.installed_version('llama-cpp')}, GGUF Q4_1 weights, "
                              "one request at a time")


def openvino_server(name: str, max_num_seqs: int) -> Server:
    variant = openvino_peer.VARIANTS[name.removeprefix("openvino-")]
    server = Server(name, note=f"OpenVINO GenAI {peers.installed_version('openvino').split()[0]}, {variant.description}, "
                                f"in-process ContinuousBatchingPipeline, max_num_seqs {max_num_seqs}")
    server.info = {"variant": variant.name, "max_num_seqs": max_num_seqs}
    return server


def make_servers(names: list[str], dtype: str, install: bool, bf16_max_concurrency: int = 8,
                 hf_max_concurrency: int | None = None, transformers_dtype: str = "auto",
                 openvino_max_num_seqs: int = 256) -> list[Server]:
    servers: list[Server] = []
    for name in names:
        if name == "spindle":
            servers.append(SpindleServer("spindle", env={"SPINDLE_DTYPE": dtype}, note=dtype))
        elif name == "spindle-fake":  # the harness's own check: no model, tokens at once
            servers.append(SpindleServer("spindle-fake", env={"SPINDLE_FAKE_MODEL": "true"}, note="fake model"))
        elif name == "spindle-bf16":
            from services.worker.config import cpu_has_native_bf16

            matmuls = ("native bfloat16 matmuls" if cpu_has_native_bf16()
                       else "batches multiply on a float32 copy of the weights: no bfloat16 arithmetic on this CPU")
            server = SpindleServer("spindle-bf16", env={"SPINDLE_DTYPE": "bfloat16"},
                                   note=f"bfloat16 weights and KV cache ({matmuls}); c<={bf16_max_concurrency} only")
            server.max_concurrency = bf16_max_concurrency
            servers.append(server)
        elif name in ("transformers-serve", "llama-cpp", "openvino-bf16", "openvino-int8"):
            peer = "openvino" if name.startswith("openvino-") else name
            why = peers.install(peer, log=log) if install else (
                "" if peers.is_installed(peer) else "not installed (python -m benchmarks.peers install " + peer + ")")
            if why:
                servers.append(Server(name, skip_reason=why))
            elif peer == "openvino":
                servers.append(openvino_server(name, openvino_max_num_seqs))
            else:
                servers.append(transformers_serve(transformers_dtype) if name == "transformers-serve"
                               else llama_cpp_server())
        elif name == "hf-generate":
            limit = f"; c<={hf_max_concurrency} only" if hf_max_concurrency else ""
            servers.append(Server("hf-generate", note=f"static batches (batch = c), {dtype}{limit}",
                                  max_concurrency=hf_max_concurrency))
        else:
            raise SystemExit(f"unknown server {name!r}")
    return servers


# --- scenarios ----------------------------------------------------------------------------------
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


def warm_up_request(tokenizer) -> ChatRequest:
    """A short request sent before the measured ones (first-call costs, lazy loading): not measured."""
    messages = [{"role": "user", "content": "Say hello."}]
    return ChatRequest(-1, messages, 8, count_prompt_tokens(tokenizer, messages), False)


def run_server(server: Server, requests, tokenizer, plan: list[dict], repeats: int, time_limit_s: float) -> dict:
    out = {"name": server.name, "note": server.note, "skip_reason": server.skip_reason, "scenarios": [],
           "latencies": {}}
    if server.skip_reason:
        log(f"{server.name}: skipped: {server.skip_reason}")
        return out
    log(f"{server.name}: starting")
    try:
        target = server.start()
    except Exception as exc:  # noqa: BLE001 - any start failure becomes the row's reason
        out["skip_reason"] = f"could not start: {str(exc)[:300]}"
        log(f"{server.name}: {out['skip_reason']}")
        return out
    try:
        warm = asyncio.run(run_scenario(target, [warm_up_request(tokenizer)], tokenizer, concurrency=1,
                                        time_limit_s=time_limit_s))
        if not warm["summary"]["num_complete"]:
            log(f"{server.name}: warm-up request failed: {warm['summary']['errors'] or 'cut by the time limit'}")
        for item in plan:
            if item.get("rate") and server.max_concurrency or (item.get("concurrency") or 0) > (
                    server.max_concurrency or 10**9):
                continue
            runs = []
            for repeat in range(repeats):
                runs.append(asyncio.run(run_scenario(
                    target, scenario_requests(requests, item, repeat), tokenizer, concurrency=item.get("concurrency"),
                    rate=item.get("rate"), seed=item.get("seed", 0), time_limit_s=time_limit_s)))
                if runs[-1]["summary"]["is_truncated"]:
                    time.sleep(SETTLE_S)  # a server may finish cancelled requests before it notices
            summary = median_of_repeats(runs)
            out["scenarios"].append(summary)
            out["latencies"][report.scenario_label(summary)] = latency_lists(runs[-1])
            log(f"{server.name} {report.scenario_label(summary)}: {summary['output_throughput']:.1f} out tok/s, "
                f"TTFT p50 {summary['ttft_ms']['p50'] or 0:.0f} ms, {summary['num_complete']}/"
                f"{summary['num_planned']} complete{', cut by the time limit' if summary['is_truncated'] else ''}")
    finally:
        server.stop()
    out["info"] = server.info
    return out


def latency_lists(run: dict) -> dict[str, list[float]]:
    """The last repeat's raw latencies in ms, for the CDF plots."""
    requests = run["requests"]
    return {
        "ttft_ms": [r["ttft_s"] * 1e3 for r in requests if r["ttft_s"] is not None],
        "e2e_ms": [r["e2e_s"] * 1e3 for r in requests if r["complete"]],
        "itl_ms": [x * 1e3 for r in requests for x in r["itls_s"]],
    }


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
               "--max-num-seqs", str(server.info["max_num_seqs"]), "--out", str(out_path)]
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
    out["info"] |= {k: raw.get(k) for k in ("openvino", "openvino_genai", "settings", "kv_cache_precision",
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


# --- main ---------------------------------------------------------------------------------------
def build_plan(args) -> list[dict]:
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = ([int(x) for x in args.num_requests.split(",")] if args.num_requests
              else [max(args.min_requests, args.requests_per_client * c) for c in levels])
    plan = [{"concurrency": c, "num_requests": n} for c, n in zip(levels, counts, strict=True)]
    for rate in [float(x) for x in args.rates.split(",") if x]:
        plan.append({"rate": rate, "num_requests": args.rate_requests, "seed": 1})
    offset = 0
    for item in plan:  # every scenario and repeat gets prompts of its own: no prefix-cache hits across them
        item["offset"] = offset
        offset += item["num_requests"] * args.repeats
    return plan


def scenario_requests(requests, item: dict, repeat: int):
    start = item["offset"] + repeat * item["num_requests"]
    return requests[start:start + item["num_requests"]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="c=1 and 8, few requests, one repeat, installed peers only")
    parser.add_argument("--servers", default="spindle,transformers-serve,llama-cpp,hf-generate,openvino-bf16,openvino-int8",
                        help="comma list of spindle, spindle-bf16, spindle-fake, transformers-serve, llama-cpp, "
                             "hf-generate, openvino-bf16, openvino-int8")
    parser.add_argument("--dtype", default="float32", help="dtype for Spindle and HF generate")
    parser.add_argument("--transformers-dtype", default="auto",
                        help="dtype for transformers serve; auto: the faster one measured here (see servers.py)")
    parser.add_argument("--openvino-max-num-seqs", type=int, default=256, help="the OpenVINO scheduler's max_num_seqs")
    parser.add_argument("--single-stream-tokens", type=int, default=256,
                        help="greedy tokens of the OpenVINO peers' single-stream row (0 to skip)")
    parser.add_argument("--bf16-max-concurrency", type=int, default=64, help="levels spindle-bf16 runs (no rates)")
    parser.add_argument("--hf-max-concurrency", type=int,
                        help="largest static batch for hf-generate (its prefill cannot be cut by the time limit)")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--num-requests", help="requests per concurrency level (default: max(min, per-client x c))")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--rates", default="1,4", help="Poisson request rates per second ('' for none)")
    parser.add_argument("--rate-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit-s", type=float, default=300, help="per scenario; open requests are then cancelled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overhead-levels", default="1,64,256,1024", help="running requests ('' to skip)")
    parser.add_argument("--prefix-requests", type=int, default=4, help="measured requests per cache setting (0 to skip)")
    parser.add_argument("--model-step", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the real model's step at 256 requests (for the overhead share)")
    parser.add_argument("--install-peers", action=argparse.BooleanOptionalAction, default=None,
                        help="install missing peers (default: yes, except with --quick)")
    parser.add_argument("--render", metavar="JSON", help="only print the tables of a saved result and redraw its plots")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/bench-<time>.json, and latest.json)")
    args = parser.parse_args(argv)
    if args.quick:
        quick = {"concurrency": "1,8", "num_requests": "4,8", "rates": "4", "rate_requests": 8, "repeats": 1,
                 "time_limit_s": 30.0, "overhead_levels": "1,64", "prefix_requests": 2, "model_step": False,
                 "single_stream_tokens": 64}
        for key, value in quick.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.install_peers is None:
        args.install_peers = not args.quick
    return args


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally`, which stops the servers


def render_saved(path: str) -> dict:
    """Prints the tables of a saved result again and redraws its plots beside it."""
    result = json.loads(Path(path).read_text())
    try:
        from benchmarks import plots

        log("plots: " + ", ".join(plots.write_plots(result, Path(path).with_suffix(""))))
    except ImportError as exc:
        log(f"plots skipped: {exc} (pip install matplotlib)")
    print(report.render(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.render:
        return render_saved(args.render)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)  # asyncio.run then leaves SIGINT to us
    started = time.monotonic()
    machine = machine_info()
    log(f"{machine['cpu']}, {machine['cpus']} CPUs, load average {machine['loadavg_before'][0]:.2f}")
    tokenizer = load_default_tokenizer()
    plan = build_plan(args)
    num_requests = sum(p["num_requests"] for p in plan) * args.repeats
    spec = WorkloadSpec(num_requests=num_requests, seed=args.seed)
    requests = build_workload(spec, tokenizer)
    workload_note = (f"seed {spec.seed}: {num_requests} chat requests, user prompt {spec.min_prompt_tokens}-"
                     f"{spec.max_prompt_tokens} tokens, output {spec.min_output_tokens}-{spec.max_output_tokens} "
                     f"forced, {spec.system_prompt_share:.0%} with a shared {spec.system_prompt_tokens}-token system prompt; "
                     f"{args.repeats} repeat(s), {args.time_limit_s:.0f} s limit per scenario")
    result = {"args": vars(args), "machine": machine, "workload": vars(spec), "workload_note": workload_note,
              "plan": plan, "servers": [], "spindle_reference": "spindle"}
    names = [n for n in args.servers.split(",") if n]
    for server in make_servers(names, args.dtype, args.install_peers, args.bf16_max_concurrency,
                               args.hf_max_concurrency, args.transformers_dtype, args.openvino_max_num_seqs):
        if server.name == "hf-generate":
            result["servers"].append(run_hf_generate(server, requests, plan, args.repeats, args.time_limit_s,
                                                     args.dtype))
        elif server.name.startswith("openvino-"):
            result["servers"].append(run_openvino(server, requests, tokenizer, plan, args.repeats, args.time_limit_s,
                                                  args.single_stream_tokens))
        else:
            result["servers"].append(run_server(server, requests, tokenizer, plan, args.repeats, args.time_limit_s))
    if args.overhead_levels:
        from benchmarks import engine_overhead

        log("engine overhead (fake-model worker)")
        result["engine_overhead"] = engine_overhead.run([int(x) for x in args.overhead_levels.split(",")])
        if args.model_step:
            result["model_step_256"] = model_step_256(args.dtype)
    if args.prefix_requests:
        from benchmarks import prefix_cache

        log("prefix cache on / off")
        result["prefix_cache"] = prefix_cache.run(args.prefix_requests, dtype=args.dtype,
                                                  time_limit_s=args.time_limit_s, tokenizer=tokenizer)
    machine["loadavg_after"] = list(os.getloadavg())
    result["wall_s"] = time.monotonic() - started
    RESULTS_DIR.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS_DIR / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    if not args.out:
        (RESULTS_DIR / "latest.json").write_text(json.dumps(result, indent=1))
    try:
        from benchmarks import plots

        result["plots"] = plots.write_plots(result, out.with_suffix(""))
        if not args.out:
            result["plots"] += plots.write_plots(result, RESULTS_DIR / "latest")
    except ImportError as exc:
        result["plots"] = []
        log(f"plots skipped: {exc} (pip install matplotlib)")
    log(f"wrote {out}; plots: {', '.join(result['plots']) or 'none'}; logs under {LOG_DIR}; "
        f"{result['wall_s'] / 60:.1f} min")
    print()
    print(report.render(result))
    return result


if __name__ == "__main__":
    main()
