"""Decode attention on an int8 KV cache against a bfloat16 one: the compiled CPU kernels
(csrc/paged_decode_int8.c, csrc/paged_decode.c), one call per layer, on this CPU.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.int8_kv_decode_bench
        [--shapes 32x400,32x1000,64x400,64x1000] [--heads 9,3,64] [--block-size 16]
        [--march native|x86-64-v3] [--only bf16|int8] [--from-cache] [--amx-attention true|false]
        [--out benchmarks/results/int8_kv_decode_bench.json]

SmolLM2-135M's attention shape by default (9 query heads sharing 3 KV heads of 64, blocks of 16),
bfloat16 queries, block tables scattered over the cache as in a long-running server. Each call
reads the next of several layers' caches, at least MIN_CYCLE_BYTES of them together, so the cache
comes from memory as in a decode step over 30 layers, not from the last-level cache. Prints
milliseconds per call (median of REPEATS timed passes over the layers) and the cache bytes read
per second (keys and values; the int8 cache's scales and midpoints included), and the largest difference of the
int8 kernel's output from the bfloat16 kernel's on the same keys and values (dequantized, then
rounded to bfloat16): quantization error, not the kernel's. `--only` times one kernel alone (the
other's figures and the difference are then left out); `--from-cache` cycles over two layers'
caches, which the last-level cache holds at small shapes: the kernels' arithmetic alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from services.worker.attention.amx_attention import use_amx_attention
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.cpu_decode_int8 import PagedDecodeInt8Kernel
from services.worker.attention.int8_kv_cache import int8_block_bytes, quantize_kv_rows, split_int8_cache
from services.worker.cpu_kernels import load_cpu_kernels

MIN_CYCLE_BYTES = 256 << 20  # several times a last-level cache
REPEATS = 7


def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, gen: torch.Generator):
    """One layer's int8 cache [2, num_blocks, block_bytes] and the same values as a bfloat16 cache
    [2, num_blocks, block_size, H_kv, D]."""
    x = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q, scales, mids = quantize_kv_rows(x)
    int8_cache = torch.empty(2, num_blocks, int8_block_bytes(block_size, num_kv_heads, head_dim), dtype=torch.int8)
    for half in range(2):
        data, half_scales, half_mids = split_int8_cache(int8_cache[half], half, block_size, num_kv_heads, head_dim)
        data.copy_(q[half].unflatten(-1, (head_dim // 4, 4)))
        half_scales.copy_(scales[half])
        half_mids.copy_(mids[half])
    bf16_cache = (q.float() * scales[..., None] + mids[..., None]).to(torch.bfloat16)
    return int8_cache, bf16_cache


def _pass_ms(calls: list) -> float:
    """Milliseconds per call, median of REPEATS passes over `calls` after one warm-up pass."""
    for call in calls:
        call()
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for call in calls:
            call()
        samples.append((time.perf_counter() - start) / len(calls) * 1e3)
    return statistics.median(samples)


def measure(int8_kernel: PagedDecodeInt8Kernel, bf16_kernel: PagedDecodeKernel, num_reqs: int, context_len: int,
            num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, only: str | None = None,
            min_cycle_bytes: int = MIN_CYCLE_BYTES) -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = -(-context_len // block_size)
    num_blocks = num_reqs * blocks_per_req + 1  # block 0 is the null block
    table = (torch.randperm(num_blocks - 1, generator=gen)[: num_reqs * blocks_per_req] + 1).view(num_reqs, -1)
    seq_lens = torch.full((num_reqs,), context_len, dtype=torch.int64)
    query = torch.randn(num_reqs, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim**-0.5
    bf16_bytes = 2 * num_reqs * context_len * num_kv_heads * head_dim * 2
    int8_bytes = 2 * num_reqs * context_len * num_kv_heads * (head_dim + 4)
    int8_cache, bf16_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, gen)
    num_layers = max(2, -(-min_cycle_bytes // int8_bytes))
    num_bf16_layers = max(2, -(-min_cycle_bytes // bf16_bytes))
    row = {"num_reqs": num_reqs, "context_len": context_len, "bf16_cache_mb": bf16_bytes / 1e6,
           "int8_cache_mb": int8_bytes / 1e6}
    if only != "bf16":
        int8_layers = [int8_cache.clone() for _ in range(num_layers)]
        int8_ms = _pass_ms([lambda c=c: int8_kernel(query, c[0], c[1], table, seq_lens, context_len, scale,
                                                    block_size, num_kv_heads, head_dim) for c in int8_layers])
        del int8_layers
        row.update(num_int8_layers=num_layers, int8_ms=int8_ms, int8_gb_per_s=int8_bytes / int8_ms / 1e6)
    if only != "int8":
        bf16_layers = [bf16_cache.clone() for _ in range(num_bf16_layers)]
        bf16_ms = _pass_ms([lambda c=c: bf16_kernel(query, c[0], c[1], table, seq_lens, context_len, scale)
                            for c in bf16_layers])
        del bf16_layers
        row.update(num_bf16_layers=num_bf16_layers, bf16_ms=bf16_ms, bf16_gb_per_s=bf16_bytes / bf16_ms / 1e6)
    if only is not None:
        return row
    int8_out = int8_kernel(query, int8_cache[0], int8_cache[1], table, seq_lens, context_len, scale, block_size, num_kv_heads, head_dim)
    bf16_out = bf16_kernel(query, bf16_cache[0], bf16_cache[1], table, seq_lens, context_len, scale)
    row.update(int8_speedup=bf16_ms / int8_ms, max_diff_int8_vs_bf16=float((int8_out - bf16_out).abs().max()))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="32x400,32x1000,64x400,64x1000", help="comma list of REQUESTSxCONTEXT")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--march", default="native")
    parser.add_argument("--only", choices=("bf16", "int8"), help="time one kernel alone")
    parser.add_argument("--from-cache", action="store_true",
                        help="cycle over two layers' caches only, so they come from the last-level cache where they "
                             "fit: the kernels' arithmetic without the memory's share")
    parser.add_argument("--amx-attention", default="true", choices=("true", "false"),
                        help="the library's --cpu-amx-attention switch: both kernels on the AMX tile unit where the CPU "
                             "has it (AMX-INT8 for the int8 cache), or false for the VNNI / AVX-512 passes")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "int8_kv_decode_bench.json"))
    args = parser.parse_args()
    os.environ["SPINDLE_CPU_KERNEL_MARCH"] = args.march
    library = load_cpu_kernels()
    if library is None:
        raise SystemExit("the CPU kernels could not be built or loaded (see the log)")
    on_tiles = use_amx_attention(library, args.amx_attention == "true")
    int8_kernel, bf16_kernel = PagedDecodeInt8Kernel(library), PagedDecodeKernel(library)
    num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    print(f"march {args.march}, {torch.get_num_threads()} threads, int8 on VDPBF16PS: {int8_kernel.has_bf16_dot}, "
          f"attention on AMX tiles: {on_tiles}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        num_reqs, context_len = (int(x) for x in shape.split("x"))
        row = measure(int8_kernel, bf16_kernel, num_reqs, context_len, num_heads, num_kv_heads, head_dim,
                      args.block_size, args.only, 0 if args.from_cache else MIN_CYCLE_BYTES)
        rows.append(row)
        if args.only is not None:
            kind = args.only
            print(f"{num_reqs:3d} requests x {context_len:5d} tokens: {kind} {row[kind + '_ms']:6.3f} ms "
                  f"({row[kind + '_gb_per_s']:5.1f} GB/s)", flush=True)
            continue
        print(f"{num_reqs:3d} requests x {context_len:5d} tokens: bf16 {row['bf16_ms']:6.3f} ms "
              f"({row['bf16_gb_per_s']:5.1f} GB/s), int8 {row['int8_ms']:6.3f} ms ({row['int8_gb_per_s']:5.1f} GB/s), "
              f"int8 {row['int8_speedup']:.2f}x; max diff {row['max_diff_int8_vs_bf16']:.1e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"march": args.march, "from_cache": args.from_cache, "amx_attention": on_tiles,
                               "heads": [num_heads, num_kv_heads, head_dim], "block_size": args.block_size,
                               "torch_threads": torch.get_num_threads(), "int8_bf16_dot": int8_kernel.has_bf16_dot,
                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
