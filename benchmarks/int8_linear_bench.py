"""Weight-only int8 matmul candidates against bf16, per shape and row count, on this CPU.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.int8_linear_bench [--rows 1,2,4,8,16,32,64,256]
        [--threads 2] [--out benchmarks/results/int8_linear.json]

Shapes are SmolLM2-135M's (hidden 576, intermediate 1536, 9 heads x 64, 3 KV heads, vocab 49152):
qkv 960x576, o 576x576, gate-up 3072x576, down 576x1536, LM head 49152x576. Candidates:
  bf16_packed      oneDNN bf16 on the prepacked bf16 weight (the bf16 model's matmul)
  int8pack_mm      torch.ops.aten._weight_int8pack_mm (int8 weight, per-channel bf16 scales)
  dequant_chunks   the int8 weight widened to bf16 1024 rows at a time, then a bf16 matmul
  w8a8_onednn      oneDNN u8s8 qlinear (VNNI/AMX) after quantizing the rows per tensor at call time:
                   not weight-only (the activations lose precision too), measured as the int8 bound
Prints milliseconds per call (median of 7 timed batches) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.worker.layers.int8_kernels import (
    dequantize_chunks_linear,
    int8pack_linear,
    quantize_per_channel,
)
from services.worker.layers.linear import pack_weight, packed_linear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def time_ms(fn, min_total_s: float = 0.05) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_total_s / 5:
        fn()
        calls += 1
    calls = max(calls, 1)
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples)


def w8a8_candidate(qweight: torch.Tensor, scales: torch.Tensor):
    """oneDNN's quantized linear with the activations quantized per tensor at call time, or None
    where this torch build lacks it."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_prepack"):
        return None
    packed = ops.qlinear_prepack(qweight, None)
    w_scale, w_zp = scales.float(), torch.zeros(scales.shape[0], dtype=torch.long)

    def run(x: torch.Tensor) -> torch.Tensor:
        lo, hi = x.min().float().clamp(max=0), x.max().float().clamp(min=0)
        scale = float((hi - lo).clamp(min=1e-8) / 255)
        zp = int(round(-float(lo) / scale))
        qx = torch.clamp(torch.round(x.float() / scale) + zp, 0, 255).to(torch.uint8)
        return ops.qlinear_pointwise(qx, scale, zp, packed, w_scale, w_zp, None, 1.0, 0, torch.bfloat16,
                                     "none", [], "")
    return run


def bench(rows: list[int]) -> list[dict]:
    results = []
    for name, (n, k) in SHAPES.items():
        torch.manual_seed(0)
        weight = torch.randn(n, k) * 0.05
        qweight, scales = quantize_per_channel(weight)
        packed_bf16 = pack_weight(weight.bfloat16())
        scales_bf16 = scales.bfloat16()
        w8a8 = w8a8_candidate(qweight, scales)
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            row = {"shape": name, "n": n, "k": k, "m": m,
                   "bf16_packed": time_ms(lambda: packed_linear(x, packed_bf16, None)),
                   "int8pack_mm": time_ms(lambda: int8pack_linear(x, qweight, scales_bf16)),
                   "dequant_chunks": time_ms(lambda: dequantize_chunks_linear(x, qweight, scales_bf16))}
            if w8a8 is not None:
                row["w8a8_onednn"] = time_ms(lambda: w8a8(x))
            results.append(row)
            print(" ".join(f"{v:>9.3f}" if isinstance(v, float) else f"{v!s:>9}" for v in row.values()), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/int8_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("    shape         n         k         m  bf16_pack int8pack  dequant    w8a8")
    with torch.no_grad():
        results = bench([int(r) for r in args.rows.split(",")])
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split()
                    if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "cpu_flags": flags, "torch": torch.__version__,
                               "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
