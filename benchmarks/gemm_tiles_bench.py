"""bfloat16 matmuls and decode steps on the column tiles (csrc/gemm_tiles.c, `--cpu-gemm-tiles`)
against the plain GEMV and oneDNN's prepacked bfloat16 GEMM, on a CPU with AVX512_BF16.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.gemm_tiles_bench
        [--matmul-rows 1,4,8,16,32,64,128,256] [--step-rows 1,8,16,32,64] [--repeats 3]
        [--out benchmarks/results/gemm_tiles.json]

Matmuls: SmolLM2-135M's four layer shapes (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536) with 30 layers' distinct random weights, so they come from memory as in a decode step,
each path over all of them, median of 7 passes. Decode steps: two workers with the decoder stack
on, `--cpu-gemm-tiles` true and false, `step_bench.run_batch` (the real scheduler, 128-token
prompts, 24 decode steps), alternating, the median of `--repeats` runs' median steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.machine_probe import cpu_flags
from benchmarks.step_bench import run_batch
from services.worker.config import WorkerConfig
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.layers.gemv import Gemv
from services.worker.layers.linear import pack_weight, packed_linear
from services.worker.worker import Worker

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NUM_LAYERS = 30
PASSES = 7


def _pass_ms(call, num_rows: int) -> float:
    xs = {name: torch.randn(num_rows, k).bfloat16() for name, (_, k) in SHAPES.items()}
    samples = []
    for _ in range(PASSES):
        start = time.perf_counter()
        for layer in range(NUM_LAYERS):
            for name in SHAPES:
                call(name, layer, xs[name])
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def matmuls(gemv: Gemv, rows: list[int]) -> list[dict]:
    weights = {name: [torch.randn(n, k).bfloat16() for _ in range(NUM_LAYERS)] for name, (n, k) in SHAPES.items()}
    onednn = {name: [pack_weight(w) for w in ws] for name, ws in weights.items()}
    tiled = {name: [gemv.pack_tiles(w) for w in ws] for name, ws in weights.items()}
    paths = {"gemv": lambda name, i, x: gemv(x, weights[name][i]),
             "onednn": lambda name, i, x: packed_linear(x, onednn[name][i], None),
             "tiles": lambda name, i, x: gemv.tiles(x, tiled[name][i])}
    results = []
    for num_rows in rows:
        gflop = 2 * num_rows * sum(n * k for n, k in SHAPES.values()) * NUM_LAYERS / 1e9
        row = {"rows": num_rows, **{f"{path}_ms": _pass_ms(call, num_rows) for path, call in paths.items()}}
        results.append(row)
        print(f"matmuls, {num_rows:3d} rows: " + ", ".join(
            f"{path} {row[f'{path}_ms']:6.2f} ms ({gflop / row[f'{path}_ms'] * 1e3:4.0f} GFLOP/s)" for path in paths),
            flush=True)
    return results


def _worker(tiles: bool) -> Worker:
    worker = Worker(WorkerConfig(dtype="bfloat16", kv_cache_bytes=512 * 2**20, max_model_len=2048,
                                 cpu_gemm_tiles=tiles))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return worker


def decode_steps(rows: list[int], repeats: int) -> list[dict]:
    workers = {tiles: _worker(tiles) for tiles in (False, True)}
    results = []
    for num_rows in rows:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for tiles, worker in workers.items():
                runs[tiles].append(run_batch(worker, num_rows, 128, 24)["decode_step_ms"])
        gemv_ms, tiles_ms = statistics.median(runs[False]), statistics.median(runs[True])
        results.append({"rows": num_rows, "gemv_and_onednn_ms": gemv_ms, "tiles_ms": tiles_ms,
                        "runs_gemv_and_onednn_ms": runs[False], "runs_tiles_ms": runs[True]})
        print(f"decode step, {num_rows:3d} rows: plain GEMV + oneDNN {gemv_ms:7.2f} ms, tiles {tiles_ms:7.2f} ms, "
              f"{gemv_ms / tiles_ms:.2f}x", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matmul-rows", default="1,4,8,16,32,64,128,256")
    parser.add_argument("--step-rows", default="1,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gemm_tiles.json"))
    args = parser.parse_args()
    library = load_cpu_kernels()
    gemv = Gemv(library) if library is not None else None
    if gemv is None or not gemv.has_tiles:
        raise SystemExit("no column tiles here: they need the CPU kernels built with AVX512_BF16")
    report = machine_header()
    report["matmuls"] = matmuls(gemv, [int(r) for r in args.matmul_rows.split(",") if r])
    report["decode_steps"] = decode_steps([int(r) for r in args.step_rows.split(",") if r], args.repeats)
    write_report(Path(args.out), report)


def machine_header() -> dict:
    """The CPU flags and torch threads a kernel report starts with, printed too."""
    flags = cpu_flags()
    print(f"CPU flags: {' '.join(flags)}; torch threads {torch.get_num_threads()}", flush=True)
    return {"cpu_flags": flags, "torch_threads": torch.get_num_threads()}


def write_report(out: Path, report: dict) -> None:
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
