"""`--kv-cache-dtype int8` against the model's own dtype on the embedded SmolLM2-135M: decode step
time by batch and context, and output drift.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.int8_kv_model_bench [--threads 2]
        [--batch-sizes 1,32,64] [--prompt-len 400] [--max-tokens 64]
        [--out benchmarks/results/int8_kv_model.json]

Speed: the worker's decode steps (benchmarks.step_bench.run_batch, the real scheduler), bf16
weights with a bf16 and with an int8 cache, each batch size run three times with the two
alternating; the median of the three runs' median steps. Drift: the 8 parity prompts of
tests/e2e/test_default_model.py, greedy for `--max-tokens` tokens with EOS ignored (as
benchmarks.int8_model_bench measures int8 weights): the int8 cache against the same dtype's own
cache in bfloat16 and in float32, bf16 against float32 beside it as the yardstick.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.int8_model_bench import cpu_flags, drift, greedy, parity_chat_prompts
from benchmarks.step_bench import run_batch
from services.worker.config import WorkerConfig
from services.worker.worker import Worker


def make_worker(dtype: str, kv_cache_dtype: str) -> Worker:
    worker = Worker(WorkerConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=1024 * 2**20,
                                 max_model_len=2048))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,32,64")
    parser.add_argument("--prompt-len", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/int8_kv_model.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = cpu_flags(args.threads)
    prompts = parity_chat_prompts()
    results: dict = {"threads": args.threads, "cpu_flags": flags, "prompt_len": args.prompt_len, "speed": {},
                     "outputs": {}}
    workers = {"bf16": make_worker("bfloat16", "auto"), "bf16-kv8": make_worker("bfloat16", "int8")}
    for name, worker in workers.items():
        results["outputs"][name] = [greedy(worker, p, args.max_tokens) for p in prompts]
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        runs = {name: [] for name in workers}
        for _ in range(3):  # alternating, so a slow minute of this shared VM hits both alike
            for name, worker in workers.items():
                runs[name].append(run_batch(worker, bs, args.prompt_len, args.decode_steps))
        for name, rows in runs.items():
            row = {k: statistics.median(r[k] for r in rows) for k in ("decode_step_ms", "decode_tok_s")}
            row["runs_step_ms"] = [r["decode_step_ms"] for r in rows]
            results["speed"][f"{name}/{bs}"] = row
            print(f"{name:9s} batch {bs:3d} x {args.prompt_len} tokens: decode step {row['decode_step_ms']:7.2f} ms "
                  f"= {row['decode_tok_s']:7.1f} tok/s (runs {', '.join(f'{t:.1f}' for t in row['runs_step_ms'])} ms)",
                  flush=True)
    del workers
    for name, kv in (("float32", "auto"), ("float32-kv8", "int8")):
        worker = make_worker("float32", kv)
        results["outputs"][name] = [greedy(worker, p, args.max_tokens) for p in prompts]
        del worker
    outputs = results["outputs"]
    results["drift"] = {"bf16-kv8_vs_bf16": drift(outputs["bf16"], outputs["bf16-kv8"]),
                        "float32-kv8_vs_float32": drift(outputs["float32"], outputs["float32-kv8"]),
                        "bf16_vs_float32": drift(outputs["float32"], outputs["bf16"])}
    for name, d in results["drift"].items():
        print(f"{name}: identical greedy {d['num_identical']}/{d['num_prompts']} over {args.max_tokens} tokens; "
              f"first divergences {[r['first_divergence'] for r in d['prompts']]}; max |dlogprob| over the "
              f"common prefix {max(r['max_abs_logprob_diff'] for r in d['prompts']):.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
