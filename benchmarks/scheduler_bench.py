"""The scheduler's own cost per steady decode step, in one process: `schedule()` and
`update_from_output()` at N running requests, no worker, no gRPC.

    .venv/bin/python -m benchmarks.scheduler_bench [--num-running 256] [--num-steps 300] [--repeats 5] [--out F]

Prints the minimum over repeats of each repeat's median (the least disturbed figure on a shared
machine) and writes benchmarks/results/scheduler_bench.json. It imports only the scheduler and the
message dataclasses, so it runs unchanged from an older checkout (PYTHONPATH=that checkout) to
compare the two.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from services.common.messages import EngineCoreRequest, ModelRunnerOutput, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

PROMPT_LEN = 30
WARMUP_STEPS = 20


def one_repeat(num_running: int, num_steps: int) -> tuple[float, float]:
    """Median microseconds of schedule() and of update_from_output() over `num_steps` decode steps."""
    blocks_per_request = -(-(PROMPT_LEN + num_steps + WARMUP_STEPS) // 16) + 1
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running),
                          num_running * blocks_per_request + 1, 16, 16384)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(num_running):
        scheduler.add_request(Request(EngineCoreRequest(f"r{i}", list(range(100, 100 + PROMPT_LEN)), params,
                                                        time.time())))
    schedule_ns, update_ns = [], []
    for step in range(num_steps + WARMUP_STEPS):
        start = time.perf_counter_ns()
        scheduler_output = scheduler.schedule()
        scheduled = time.perf_counter_ns()
        req_ids = list(scheduler_output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[5] for _ in req_ids])
        before_update = time.perf_counter_ns()
        scheduler.update_from_output(scheduler_output, runner_output)
        updated = time.perf_counter_ns()
        if step >= WARMUP_STEPS:  # the first steps prefill
            schedule_ns.append(scheduled - start)
            update_ns.append(updated - before_update)
    return statistics.median(schedule_ns) / 1000, statistics.median(update_ns) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scheduler_bench.json"))
    args = parser.parse_args()
    runs = [one_repeat(args.num_running, args.num_steps) for _ in range(args.repeats)]
    result = {"num_running": args.num_running, "num_steps": args.num_steps,
              "schedule_us": min(r[0] for r in runs), "update_from_output_us": min(r[1] for r in runs),
              "runs": [{"schedule_us": s, "update_from_output_us": u} for s, u in runs]}
    print(f"{args.num_running} running: schedule() {result['schedule_us']:.1f} us, "
          f"update_from_output() {result['update_from_output_us']:.1f} us (min of {args.repeats} medians)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
