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
import subprocess
import time
from pathlib import Path

from benchmarks import machine_probe, report, single_stream
from benchmarks.inprocess_peers import model_step_256, run_hf_generate, run_openvino
from benchmarks.loadgen import run_scenario
from benchmarks.repeats import latency_lists, log, median_of_repeats
from benchmarks.server_catalog import make_servers
from benchmarks.servers import LOG_DIR, RESULTS_DIR, Server
from benchmarks.workload import (ChatRequest, WorkloadSpec, build_workload, count_prompt_tokens,
                                load_default_tokenizer)

ROOT = Path(__file__).resolve().parents[1]
SETTLE_S = 3.0


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
            "loadavg_before": list(os.getloadavg()), "floors": machine_probe.probe()}


# --- scenarios ----------------------------------------------------------------------------------
def warm_up_request(tokenizer) -> ChatRequest:
    """A short request sent before the measured ones (first-call costs, lazy loading): not measured."""
    messages = [{"role": "user", "content": "Say hello."}]
    return ChatRequest(-1, messages, 8, count_prompt_tokens(tokenizer, messages), False)


def run_server(server: Server, requests, tokenizer, plan: list[dict], repeats: int, time_limit_s: float,
               single_stream_tokens: int = 0) -> dict:
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
        if single_stream_tokens and server.forces_length:
            out["single_stream"] = single_stream.run_http(target, tokenizer, single_stream_tokens, repeats, time_limit_s)
            log(f"{server.name} single stream: {out['single_stream']}")
    finally:
        server.stop()
    out["info"] = server.info
    return out


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
                        help="greedy tokens of the single-stream row, every server that forces lengths (0 to skip)")
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
            result["servers"].append(run_server(server, requests, tokenizer, plan, args.repeats, args.time_limit_s,
                                                args.single_stream_tokens))
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
