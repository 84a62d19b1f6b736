"""Model-step benchmark, in one process and without gRPC: prefill and decode step times of the worker.

    .venv/bin/python -m benchmarks.step_bench [--dtype float32] [--attention-backend auto|torch]
        [--batch-sizes 1,8,32,64] [--prompt-len 128] [--repeats 3] [--out F]

Prints a table and writes benchmarks/results/step_bench.json. Scheduling is done by the real
Scheduler, so the steps are the ones the engine would run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.common.messages import EngineCoreRequest, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.worker import Worker


def make_worker(dtype: str, kv_cache_bytes: int, attention_backend: str = "auto") -> Worker:
    worker = Worker(WorkerConfig(dtype=dtype, kv_cache_bytes=kv_cache_bytes, max_model_len=2048,
                                 attention_backend=attention_backend))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return worker


def run_batch(worker: Worker, batch_size: int, prompt_len: int, num_decode_steps: int,
              max_num_batched_tokens: int | None = None) -> dict:
    """Every prompt in the first step unless `max_num_batched_tokens` caps it (then the first step
    is a prefill of that many tokens, as the engine runs one under load)."""
    spec = worker.describe_kv_cache()
    budget = max_num_batched_tokens or max(2048, batch_size * prompt_len)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget),
                          spec.num_blocks, spec.block_size, spec.max_model_len)
    worker.model_runner.reset()
    for i in range(batch_size):
        prompt = [(7 * i + j) % 40000 + 100 for j in range(prompt_len)]
        scheduler.add_request(Request(EngineCoreRequest(
            f"b{i}", prompt, SamplingParams(temperature=0, max_tokens=num_decode_steps + 1, ignore_eos=True), 0.0)))
    step_ms = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        start = time.perf_counter()
        ro = worker.execute_model(so)
        step_ms.append((time.perf_counter() - start) * 1e3)
        scheduler.update_from_output(so, ro)
    prefill_ms, decode_ms = step_ms[0], step_ms[1:-1] or step_ms[1:]
    median_decode = statistics.median(decode_ms)
    return {"batch_size": batch_size, "prompt_len": prompt_len, "prefill_ms": prefill_ms,
            "decode_step_ms": median_decode, "decode_tok_s": batch_size / median_decode * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch"])
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 2**30)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_bench.json"))
    args = parser.parse_args()
    worker = make_worker(args.dtype, args.kv_cache_bytes, args.attention_backend)
    rows = []
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        runs = [run_batch(worker, bs, args.prompt_len, args.decode_steps) for _ in range(args.repeats)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append(row)
        print(f"batch {bs:4d}: prefill {row['prefill_ms']:8.1f} ms ({bs * args.prompt_len} tokens), "
              f"decode step {row['decode_step_ms']:7.1f} ms = {row['decode_tok_s']:7.1f} tok/s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "attention_backend": args.attention_backend,
                               "torch_threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
