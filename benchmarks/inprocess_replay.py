"""The harness's chat workload through the engine in one process: the real Scheduler and Worker,
no gRPC, no HTTP, no frontend; a closed loop of `--concurrency` requests.

    .venv/bin/python -m benchmarks.inprocess_replay [--concurrency 32] [--num-requests 32] [--first-request 0]
        [--dtype bfloat16] [--quantization none|int8] [--kv-cache-dtype auto|int8]
        [--cpu-gemm-tiles true|false] [--cpu-fused-decode true|false] [--cpu-greedy-head-screen true|false]
        [--out F]

What it separates: the worker's own step time (prefill steps, decode-only steps) from what serving
over HTTP adds (compare `out tok/s` with the harness's row at the same level and requests). Prints
a summary and writes JSON (default benchmarks/results/inprocess_replay.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.workload import WorkloadSpec, build_workload, load_default_tokenizer
from services.common.messages import EngineCoreRequest, FinishReason, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.worker import Worker


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def replay(worker: Worker, prompts: list[tuple[list[int], int]], concurrency: int) -> dict:
    spec = worker.describe_kv_cache()
    scheduler = Scheduler(SchedulerConfig(), spec.num_blocks, spec.block_size, spec.max_model_len)
    next_index = 0

    def add() -> None:
        nonlocal next_index
        ids, max_tokens = prompts[next_index]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request(EngineCoreRequest(f"r{next_index}", ids, params, time.time())))
        next_index += 1

    for _ in range(min(concurrency, len(prompts))):
        add()
    steps = {"prefill": [], "decode": []}  # (seconds, scheduled tokens, scheduled requests)
    num_output_tokens, start = 0, time.perf_counter()
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        step_start = time.perf_counter()
        runner_output = worker.execute_model(scheduler_output)
        step_s = time.perf_counter() - step_start
        num_tokens, num_reqs = scheduler_output.total_num_scheduled_tokens, len(scheduler_output.num_scheduled_tokens)
        steps["prefill" if num_tokens > num_reqs else "decode"].append((step_s, num_tokens, num_reqs))
        outputs = scheduler.update_from_output(scheduler_output, runner_output)
        num_output_tokens += sum(len(ids) for ids in outputs.new_token_ids)
        for extras in outputs.extras.values():
            if extras.finish_reason != FinishReason.NONE and next_index < len(prompts):
                add()  # a closed loop: a finished request is replaced at once
    duration_s = time.perf_counter() - start
    summary = {"concurrency": concurrency, "num_requests": len(prompts), "duration_s": duration_s,
               "num_output_tokens": num_output_tokens, "output_tok_s": num_output_tokens / duration_s}
    for kind, rows in steps.items():
        summary[kind] = {"num_steps": len(rows), "total_s": sum(r[0] for r in rows),
                         "num_tokens": sum(r[1] for r in rows),
                         "median_step_ms": statistics.median(r[0] for r in rows) * 1e3 if rows else None,
                         "mean_num_reqs": statistics.mean(r[2] for r in rows) if rows else None}
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--w8a8-group-size", type=int, default=-1,
                        help="the worker's --w8a8-group-size (the harness's W8A8 rows: 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-request", type=int, default=0,
                        help="the workload's index of the first request: the harness gives each scenario and repeat "
                             "its own slice (c=64's three repeats after c=1 and c=32's: 108, 172, 236)")
    parser.add_argument("--cpu-gemm-tiles", default="true", choices=["true", "false"],
                        help="the worker's --cpu-gemm-tiles (bfloat16 tiles; W8A8's int8 tiles)")
    parser.add_argument("--cpu-fused-decode", default="true", choices=["true", "false"],
                        help="the worker's --cpu-fused-decode (a decode step's layers in one call)")
    parser.add_argument("--cpu-greedy-head-screen", default="true", choices=["true", "false"],
                        help="the worker's --cpu-greedy-head-screen (greedy steps read the LM head in int8)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "inprocess_replay.json"))
    args = parser.parse_args(argv)
    tokenizer = load_default_tokenizer()
    requests = build_workload(WorkloadSpec(num_requests=args.first_request + args.num_requests, seed=args.seed),
                              tokenizer)[args.first_request:]
    prompts = [(prompt_ids(tokenizer, r.messages), r.max_tokens) for r in requests]
    worker = Worker(WorkerConfig(dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                 w8a8_group_size=args.w8a8_group_size,
                                 kv_cache_bytes=2 * 2**30, cpu_gemm_tiles=args.cpu_gemm_tiles == "true",
                                 cpu_fused_decode=args.cpu_fused_decode == "true",
                                 cpu_greedy_head_screen=args.cpu_greedy_head_screen == "true"))
    worker.load_model()
    worker.initialize_kv_cache(0)
    summary = replay(worker, prompts, args.concurrency) | {"first_request": args.first_request,
                                                           "dtype": args.dtype, "quantization": args.quantization,
                                                           "cpu_gemm_tiles": args.cpu_gemm_tiles == "true",
                                                           "cpu_fused_decode": args.cpu_fused_decode == "true",
                                                           "cpu_greedy_head_screen":
                                                               args.cpu_greedy_head_screen == "true"}
    print(f"c={summary['concurrency']}, {summary['num_requests']} requests, {args.dtype} {args.quantization}: "
          f"{summary['output_tok_s']:.1f} out tok/s over {summary['duration_s']:.1f} s")
    for kind in ("prefill", "decode"):
        k = summary[kind]
        print(f"  {kind}: {k['num_steps']} steps, {k['total_s']:.2f} s, {k['num_tokens']} tokens, median step "
              f"{k['median_step_ms'] or 0:.1f} ms, {k['mean_num_reqs'] or 0:.1f} requests a step")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
