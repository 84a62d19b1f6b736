"""W8A8 matmuls on the int8 column tiles (csrc/gemm_int8_tiles.c) against oneDNN's int8 GEMM with
its quantize / rescale passes (`W8A8Kernels.linear`), and the bfloat16 column tiles beside them, on
a CPU with AVX512_VNNI.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.int8_tiles_bench
        [--matmul-rows 8,17,40,64,128,256,512,2048] [--group-sizes 0,32]
        [--out benchmarks/results/int8_tiles.json]

SmolLM2-135M's four layer shapes with 30 layers' distinct random weights, so they come from memory
as in a step, each path over all of them, median of 7 passes (gemm_tiles_bench's method). The int8
tiles run once per activation group size (`int8_tiles` per row, `int8_tiles_g32` in groups of 32).
The bfloat16 tiles need AVX512_BF16; without it their column is left out.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.gemm_tiles_bench import NUM_LAYERS, SHAPES, _pass_ms, machine_header, write_report
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.layers.gemv import Gemv
from services.worker.layers.int8_kernels import quantize_per_channel
from services.worker.layers.w8a8 import W8A8Kernels


def matmuls(library, gemv: Gemv, rows: list[int], group_sizes: list[int]) -> list[dict]:
    kernels = W8A8Kernels(library)
    weights = {name: [torch.randn(n, k).bfloat16() for _ in range(NUM_LAYERS)] for name, (n, k) in SHAPES.items()}
    int8 = {name: [quantize_per_channel(w.float()) for w in ws] for name, ws in weights.items()}
    int8_tiles = {name: [kernels.pack_tiles(q, s) for q, s in qs] for name, qs in int8.items()}
    paths = {}
    for group_size in group_sizes:
        grouped = W8A8Kernels(library, group_size=group_size)
        paths[f"int8_tiles_g{group_size}" if group_size else "int8_tiles"] = \
            lambda name, i, x, grouped=grouped: grouped.tiles(x, int8_tiles[name][i])
    paths["onednn_int8"] = lambda name, i, x: kernels.linear(x, *int8[name][i])
    if gemv.has_tiles:
        bf16_tiles = {name: [gemv.pack_tiles(w) for w in ws] for name, ws in weights.items()}
        paths["bf16_tiles"] = lambda name, i, x: gemv.tiles(x, bf16_tiles[name][i])
    results = []
    for num_rows in rows:
        row = {"rows": num_rows, **{f"{path}_ms": _pass_ms(call, num_rows) for path, call in paths.items()}}
        results.append(row)
        print(f"matmuls, {num_rows:4d} rows: " + ", ".join(f"{path} {row[f'{path}_ms']:7.2f} ms" for path in paths),
              flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matmul-rows", default="8,17,40,64,128,256,512,2048")
    parser.add_argument("--group-sizes", default="0,32", help="activation group sizes of the int8 tiles (0: per row)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "int8_tiles.json"))
    args = parser.parse_args()
    library = load_cpu_kernels()
    if library is None or not W8A8Kernels(library).has_tiles:
        raise SystemExit("no int8 column tiles here: they need the CPU kernels built with AVX512_VNNI")
    report = machine_header()
    report["matmuls"] = matmuls(library, Gemv(library), [int(r) for r in args.matmul_rows.split(",") if r],
                                [int(g) for g in args.group_sizes.split(",") if g])
    write_report(Path(args.out), report)


if __name__ == "__main__":
    main()
