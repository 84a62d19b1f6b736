"""Weight-only int8 matmul candidates against bf16, per shape and row count, on this CPU.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.int8_linear_bench [--suites hot,decode]
        [--rows 1,2,4,8,16,32,64,256] [--decode-rows 1,2,4,8,16] [--decode-dtype bfloat16] [--threads 2]
        [--out benchmarks/results/int8_linear.json]

Shapes are SmolLM2-135M's (hidden 576, intermediate 1536, 9 heads x 64, 3 KV heads, vocab 49152):
qkv 960x576, o 576x576, gate-up 3072x576, down 576x1536, LM head 49152x576. Candidates:
  bf16_packed      oneDNN bf16 on the prepacked bf16 weight (the bf16 model's matmul)
  int8pack_mm      torch.ops.aten._weight_int8pack_mm (int8 weight, per-channel bf16 scales)
  dequant_chunks   the int8 weight widened to bf16 1024 rows at a time, then a bf16 matmul
  w8a8_onednn      oneDNN u8s8 qlinear (VNNI/AMX) after quantizing the rows per tensor at call time:
                   not weight-only (the activations lose precision too), measured as the int8 bound
Prints milliseconds per call (median of 7 timed batches) and writes JSON.

The `decode` suite times the decode-sized matmuls with the weights coming from memory, as in a
decode step (NUM_LAYERS copies of each layer shape cycled, 2 of the LM head), on bf16 rows (or
`--decode-dtype float32`):
  int8_gemv        the compiled int8 GEMV (csrc/gemv_int8.c), called directly, so also above the
                   row limit up to which Int8Weight.linear takes it (MAX_INT8_GEMV_ROWS)
  int8_torch       Int8Weight.linear without it: int8pack_mm or the widening GEMM by the row count
                   measured at start-up (the int8 path before the GEMV, and above its row limit)
  bf16_gemv        the compiled bf16 GEMV (csrc/gemv.c) on the bf16 weight (the bf16 model's path)
It prints microseconds per call (median of 7 passes over the copies) and the 30 layers' matmuls
(qkv, o, gate_up, down of each layer in turn) in milliseconds per pass, median of 7.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.worker.config import cpu_has_native_bf16
from services.worker.cpu_kernels import load_cpu_kernels
from services.worker.layers.gemv import Gemv
from services.worker.layers.int8_gemv import Int8Gemv
from services.worker.layers.int8_kernels import (
    dequantize_chunks_linear,
    int8pack_linear,
    quantize_per_channel,
)
from services.worker.layers.int8_linear import Int8PathSelector, Int8Weight
from services.worker.layers.linear import pack_weight, packed_linear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
NUM_LAYERS = 30
DECODE_KERNELS = ("int8_gemv", "int8_torch", "bf16_gemv")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


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


def pass_ms(calls: list, repeats: int = 7) -> float:
    """Milliseconds per pass over `calls`, median of `repeats` passes after one warm-up pass."""
    for call in calls:
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def decode_weights(n: int, k: int, num_copies: int, dtype: torch.dtype, int8_gemv: Int8Gemv,
                   selector: Int8PathSelector) -> dict:
    """`num_copies` random weights of one shape as each decode kernel reads them."""
    copies = {name: [] for name in DECODE_KERNELS}
    for _ in range(num_copies):
        weight = torch.randn(n, k) * 0.05
        qweight, scales = quantize_per_channel(weight)
        torch_path = Int8Weight(qweight, scales, native_bf16=cpu_has_native_bf16())
        torch_path.max_int8pack_rows = selector.max_int8pack_rows(torch_path, dtype)
        assert int8_gemv.supports_weight(qweight, scales)
        copies["int8_gemv"].append((qweight, scales))
        copies["int8_torch"].append(torch_path)
        copies["bf16_gemv"].append(weight.bfloat16())
    return copies


def decode_call(kernel: str, weight, x: torch.Tensor, int8_gemv: Int8Gemv, bf16_gemv: Gemv):
    if kernel == "int8_gemv":
        return lambda: int8_gemv(x, *weight)
    if kernel == "bf16_gemv":
        return lambda: bf16_gemv(x, weight)
    return lambda: weight.linear(x)


def bench_decode(rows: list[int], dtype: torch.dtype) -> dict:
    library = load_cpu_kernels()
    if library is None:
        raise SystemExit("the CPU kernels did not build: no GEMV to time")
    int8_gemv, bf16_gemv = Int8Gemv(library), Gemv(library)
    selector = Int8PathSelector()
    torch.manual_seed(0)
    weights = {name: decode_weights(n, k, 2 if name == "lm_head" else NUM_LAYERS, dtype, int8_gemv, selector)
               for name, (n, k) in SHAPES.items()}
    per_shape, layers = [], []
    print(f"decode matmuls, weights from memory, {str(dtype).removeprefix('torch.')} x; us per call (int8 GEMV "
          f"bf16 dot products: {int8_gemv.has_bf16_dot})")
    print(f"{'shape':>8} {'m':>3} " + " ".join(f"{k:>10}" for k in DECODE_KERNELS))
    for name, (n, k) in SHAPES.items():
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            row = {"shape": name, "n": n, "k": k, "m": m}
            for kernel in DECODE_KERNELS:
                copies = weights[name][kernel]
                calls = [decode_call(kernel, w, x, int8_gemv, bf16_gemv) for w in copies]
                row[kernel] = pass_ms(calls) / len(copies) * 1e3
            per_shape.append(row)
            print(f"{name:>8} {m:>3} " + " ".join(f"{row[kn]:>10.1f}" for kn in DECODE_KERNELS), flush=True)
    layer_shapes = [name for name in SHAPES if name != "lm_head"]
    int8_bytes = NUM_LAYERS * sum(n * k for name, (n, k) in SHAPES.items() if name != "lm_head")
    print(f"{NUM_LAYERS} layers' matmuls ({int8_bytes / 1e6:.0f} MB int8, {2 * int8_bytes / 1e6:.0f} MB bf16), "
          f"ms per pass (GB/s)")
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in SHAPES.values()}}
        row = {"m": m}
        for kernel in DECODE_KERNELS:
            calls = [decode_call(kernel, weights[name][kernel][layer], xs[SHAPES[name][1]], int8_gemv, bf16_gemv)
                     for layer in range(NUM_LAYERS) for name in layer_shapes]
            row[kernel] = pass_ms(calls)
        layers.append(row)
        read = {kn: (2 if kn == "bf16_gemv" else 1) * int8_bytes / row[kn] / 1e6 for kn in DECODE_KERNELS}
        print(f"m={m:<3} " + "  ".join(f"{kn} {row[kn]:6.2f} ({read[kn]:4.1f})" for kn in DECODE_KERNELS), flush=True)
    return {"per_shape": per_shape, "layers": layers, "num_layers": NUM_LAYERS, "dtype": str(dtype),
            "int8_gemv_bf16_dot": int8_gemv.has_bf16_dot}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suites", default="hot,decode")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--decode-rows", default="1,2,4,8,16")
    parser.add_argument("--decode-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/int8_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    suites = args.suites.split(",")
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f in CPU_FLAGS})
    print(f"CPU flags: {' '.join(flags)}; {args.threads} threads; torch {torch.__version__}")
    report = {"threads": args.threads, "cpu_flags": flags, "torch": torch.__version__}
    with torch.no_grad():
        if "hot" in suites:
            print("    shape         n         k         m  bf16_pack int8pack  dequant    w8a8")
            report["results"] = bench([int(r) for r in args.rows.split(",")])
        if "decode" in suites:
            report["decode"] = bench_decode([int(r) for r in args.decode_rows.split(",")],
                                            getattr(torch, args.decode_dtype))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
