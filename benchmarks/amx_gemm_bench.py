"""bfloat16 matmuls and decode steps on the AMX GEMM (csrc/gemm_amx_bf16.c, `--cpu-amx-gemm`)
against oneDNN's prepacked bfloat16 GEMM, on a CPU with AMX-BF16; and the same weights in int8 on
its int8 panels (`--quantization int8`) against the int8 GEMV.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.amx_gemm_bench
        [--matmul-rows 1,4,8,16,32,48,64,128,256] [--step-rows 32,48] [--prompt-len 360]
        [--kv-cache-dtype auto|int8] [--repeats 3] [--out benchmarks/results/amx_gemm.json]

Matmuls: SmolLM2-135M's four layer shapes over 30 layers' distinct random weights (from memory, as
in a decode step) and its LM head, each kernel in turn, median of 15 alternating passes; the int8
GEMV up to its 16 rows. Decode
steps: two workers, `--cpu-amx-gemm` true and false, `step_bench.run_batch` (the real scheduler,
`--prompt-len` prompts, 40 decode steps), alternating, the median of `--repeats` runs' medians.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.gemm_tiles_bench import NUM_LAYERS, SHAPES, machine_header, write_report
from benchmarks.step_bench import run_batch
from services.worker.config import WorkerConfig
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.layers.amx_gemm import AmxGemm
from services.worker.layers.int8_gemv import MAX_INT8_GEMV_ROWS, Int8Gemv
from services.worker.layers.int8_kernels import quantize_per_channel
from services.worker.layers.linear import pack_weight, packed_linear
from services.worker.worker import Worker

HEAD = (49152, 576)
PASSES = 15


def matmuls(gemm: AmxGemm, int8_gemv: Int8Gemv, rows: list[int]) -> list[dict]:
    weights = {name: [torch.randn(n, k).bfloat16() * 0.02 for _ in range(NUM_LAYERS)]
               for name, (n, k) in SHAPES.items()}
    onednn = {name: [pack_weight(w) for w in ws] for name, ws in weights.items()}
    amx = {name: [gemm.pack(w, 0) for w in ws] for name, ws in weights.items()}
    int8 = {name: [quantize_per_channel(w.float()) for w in ws] for name, ws in weights.items()}
    amx_int8 = {name: [gemm.pack_int8(q, s, 0) for q, s in qs] for name, qs in int8.items()}
    head = torch.randn(*HEAD).bfloat16() * 0.02
    head_onednn, head_amx = pack_weight(head), gemm.pack(head, 0)
    results = []
    for num_rows in rows:
        xs = {name: torch.randn(num_rows, k).bfloat16() for name, (_, k) in SHAPES.items()}
        x_head = torch.randn(num_rows, HEAD[1]).bfloat16()
        paths = {"onednn": lambda: [packed_linear(xs[n], w, None) for n, ws in onednn.items() for w in ws],
                 "amx": lambda: [gemm(xs[n], w) for n, ws in amx.items() for w in ws],
                 "amx_int8": lambda: [gemm(xs[n], w) for n, ws in amx_int8.items() for w in ws],
                 "head_onednn": lambda: packed_linear(x_head, head_onednn, None),
                 "head_amx": lambda: gemm(x_head, head_amx)}
        if num_rows <= MAX_INT8_GEMV_ROWS:
            paths["int8_gemv"] = lambda: [int8_gemv(xs[n], q, s) for n, qs in int8.items() for q, s in qs]
        samples: dict[str, list[float]] = {path: [] for path in paths}
        for call in paths.values():
            call()
        for _ in range(PASSES):
            for path, call in paths.items():
                start = time.perf_counter()
                call()
                samples[path].append((time.perf_counter() - start) * 1e3)
        row = {"rows": num_rows, **{f"{path}_ms": statistics.median(s) for path, s in samples.items()}}
        results.append(row)
        print(f"matmuls, {num_rows:3d} rows: 30 layers oneDNN {row['onednn_ms']:6.2f} ms, AMX GEMM "
              f"{row['amx_ms']:6.2f} ms ({row['onednn_ms'] / row['amx_ms']:.2f}x); LM head oneDNN "
              f"{row['head_onednn_ms']:5.2f} ms, AMX GEMM {row['head_amx_ms']:5.2f} ms; int8 weights: AMX GEMM "
              f"{row['amx_int8_ms']:6.2f} ms" + (f", int8 GEMV {row['int8_gemv_ms']:6.2f} ms" if "int8_gemv_ms" in row
                                                  else ""), flush=True)
    return results


def _worker(amx: bool, kv_cache_dtype: str) -> Worker:
    worker = Worker(WorkerConfig(dtype="bfloat16", kv_cache_bytes=2 * 2**30, max_model_len=2048,
                                 kv_cache_dtype=kv_cache_dtype, cpu_amx_gemm=amx))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return worker


def decode_steps(rows: list[int], prompt_len: int, kv_cache_dtype: str, repeats: int) -> list[dict]:
    workers = {amx: _worker(amx, kv_cache_dtype) for amx in (False, True)}
    results = []
    for num_rows in rows:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for worker in workers.values():
            run_batch(worker, num_rows, prompt_len, 4)  # warm-up
        for _ in range(repeats):
            for amx, worker in workers.items():
                runs[amx].append(run_batch(worker, num_rows, prompt_len, 40)["decode_step_ms"])
        onednn_ms, amx_ms = statistics.median(runs[False]), statistics.median(runs[True])
        results.append({"rows": num_rows, "onednn_ms": onednn_ms, "amx_ms": amx_ms,
                        "runs_onednn_ms": runs[False], "runs_amx_ms": runs[True]})
        print(f"decode step, {num_rows:3d} rows x {prompt_len} tokens ({kv_cache_dtype} cache): oneDNN "
              f"{onednn_ms:6.2f} ms, AMX GEMM {amx_ms:6.2f} ms, {onednn_ms / amx_ms:.2f}x", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matmul-rows", default="1,4,8,16,32,48,64,128,256")
    parser.add_argument("--step-rows", default="32,48")
    parser.add_argument("--prompt-len", type=int, default=360)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "amx_gemm.json"))
    args = parser.parse_args()
    library = load_cpu_kernels()
    gemm = AmxGemm(library) if library is not None else None
    if gemm is None or not gemm.available:
        raise SystemExit("no AMX GEMM here: it needs AMX-BF16 and the CPU kernels built for it")
    report = machine_header()
    report["matmuls"] = matmuls(gemm, Int8Gemv(library), [int(r) for r in args.matmul_rows.split(",") if r])
    report["decode_steps"] = decode_steps([int(r) for r in args.step_rows.split(",") if r], args.prompt_len,
                                          args.kv_cache_dtype, args.repeats)
    write_report(Path(args.out), report)


if __name__ == "__main__":
    main()
