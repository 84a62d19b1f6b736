"""Decode steps with the decoder layers in one compiled call against one by one (`--cpu-fused-decode`).

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.fused_decode_bench
        [--configs bfloat16:none,float32:int8,bfloat16:int8] [--batch-sizes 1,4,16] [--prompt-len 128]
        [--repeats 3] [--out benchmarks/results/fused_decode.json]

For each dtype:quantization two workers are loaded side by side, `cpu_fused_decode` off and on;
each batch size runs `step_bench.run_batch` (the real scheduler, `--prompt-len` tokens a prompt,
24 decode steps, the prompts prefilled in one step) on both, alternating, `--repeats` times; the figure is the median of the runs' median
decode steps. The CPU flags are printed and saved with the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.machine_probe import cpu_flags
from benchmarks.step_bench import run_batch
from services.worker.config import WorkerConfig
from services.worker.worker import Worker


def make_worker(dtype: str, quantization: str, fused: bool, kv_cache_bytes: int) -> Worker:
    worker = Worker(WorkerConfig(dtype=dtype, quantization=quantization, kv_cache_bytes=kv_cache_bytes,
                                 max_model_len=2048, cpu_fused_decode=fused))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="bfloat16:none,float32:int8,bfloat16:int8")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fused_decode.json"))
    args = parser.parse_args()
    flags = cpu_flags()
    print(f"CPU flags: {' '.join(flags)}; torch threads {torch.get_num_threads()}")
    rows = []
    for config in args.configs.split(","):
        dtype, quantization = config.split(":")
        # Room for the largest batch's prompts and decodes, twice over (float32 rows of SmolLM2 size).
        max_tokens = max(int(b) for b in args.batch_sizes.split(",")) * (args.prompt_len + 32)
        kv_cache_bytes = max(256 * 2**20, 2 * max_tokens * 30 * 2 * 3 * 64 * 4)
        workers = {fused: make_worker(dtype, quantization, fused, kv_cache_bytes) for fused in (False, True)}
        attached = workers[True].model_runner.model.model.decode_stack is not None
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for fused, worker in workers.items():
                    runs[fused].append(run_batch(worker, batch_size, args.prompt_len, 24)["decode_step_ms"])
            off, on = statistics.median(runs[False]), statistics.median(runs[True])
            rows.append({"dtype": dtype, "quantization": quantization, "batch_size": batch_size,
                         "prompt_len": args.prompt_len,
                         "stack_attached": attached, "one_by_one_ms": off, "one_call_ms": on,
                         "speedup": off / on, "runs_one_by_one_ms": runs[False], "runs_one_call_ms": runs[True]})
            print(f"{dtype:9s} {quantization:5s} batch {batch_size:3d}: layers one by one {off:7.2f} ms, "
                  f"one call {on:7.2f} ms, {off / on:.2f}x", flush=True)
        del workers
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu_flags": flags, "torch_threads": torch.get_num_threads(), "rows": rows},
                              indent=2))


if __name__ == "__main__":
    main()
