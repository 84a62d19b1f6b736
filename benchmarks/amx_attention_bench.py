"""Prefill and decode steps with attention on the AMX tile unit (csrc/paged_decode_amx.c,
csrc/paged_prefill_amx.h, `--cpu-amx-attention`) against the AVX-512 kernels.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.amx_attention_bench
        [--rows 32,48,64] [--prompt-len 360] [--repeats 3] [--kv-cache-bytes 2147483648]
        [--max-num-batched-tokens 2048]
        [--out benchmarks/results/amx_attention.json]

One bfloat16 worker of the default model (the AMX GEMM as configured by default);
`step_bench.run_batch` (the real scheduler, greedy, 360 prompt tokens, 40 decode steps), the
attention switch flipped between runs, the two interleaved `--repeats` times. Prints the medians
of the first step (a prefill of the token budget's 2,048 tokens, as the engine runs one) and of
the decode steps. On a CPU without AMX-BF16 the AMX figures repeat the AVX-512 ones (the switch does
not turn on; said in the output).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.machine_probe import cpu_flags
from benchmarks.step_bench import run_batch
from services.worker.attention.amx_attention import use_amx_attention
from services.worker.config import WorkerConfig
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.worker import Worker


def _worker(kv_cache_bytes: int) -> Worker:
    worker = Worker(WorkerConfig(dtype="bfloat16", kv_cache_bytes=kv_cache_bytes, max_model_len=2048))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="32,48,64")
    parser.add_argument("--prompt-len", type=int, default=360)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 2**30)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the token budget, so the first step is a prefill of this many tokens (the engine's)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "amx_attention.json"))
    args = parser.parse_args()

    worker = _worker(args.kv_cache_bytes)
    library = load_cpu_kernels()  # the worker's library: its switch is theirs
    has_amx = use_amx_attention(library, True)
    print(f"CPU flags {' '.join(cpu_flags())}; AMX attention available: {has_amx}", flush=True)
    results = []
    for num_rows in [int(r) for r in args.rows.split(",")]:
        runs: dict[str, list[float]] = {}
        run_batch(worker, num_rows, args.prompt_len, 4)  # warm-up
        for _ in range(args.repeats):
            for amx in (False, True):
                use_amx_attention(library, amx)
                result = run_batch(worker, num_rows, args.prompt_len, 40, args.max_num_batched_tokens)
                path = "amx" if amx else "avx512"
                runs.setdefault(f"decode_{path}_ms", []).append(result["decode_step_ms"])
                runs.setdefault(f"prefill_{path}_ms", []).append(result["prefill_ms"])
        use_amx_attention(library, True)
        row = {"rows": num_rows, **{key: statistics.median(v) for key, v in runs.items()},
               "runs": runs}
        results.append(row)
        print(f"{num_rows:3d} rows x {args.prompt_len} tokens: " + ", ".join(
            f"{step} step AVX-512 {row[f'{step}_avx512_ms']:7.2f} ms, AMX {row[f'{step}_amx_ms']:7.2f} ms "
            f"({row[f'{step}_avx512_ms'] / row[f'{step}_amx_ms']:.2f}x)" for step in ("prefill", "decode")), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu_flags": cpu_flags(), "amx_attention": has_amx, "prompt_len": args.prompt_len,
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
