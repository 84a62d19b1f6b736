"""Decode-attention kernel benchmark: one call of the compiled CPU kernel (one layer) per shape.

SmolLM2-135M's attention shape (9 query heads sharing 3 KV heads of 64) by default, block tables
scattered over the cache as in a long-running server. Reports milliseconds per call, the KV bytes
read per second, and the maximum difference from PyTorch's gather + SDPA path.

    .venv/bin/python -m benchmarks.attention_bench [--shapes 1x280,64x280,32x1000] [--dtypes bfloat16,float32]
        [--march native|x86-64-v3] [--out F]

`--march x86-64-v3` builds the portable library an image ships (no AVX512_BF16 paths).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.cpu_kernels import load_cpu_kernels

BLOCK_SIZE = 16


def measure(kernel: PagedDecodeKernel, dtype: torch.dtype, num_reqs: int, context_len: int, num_heads: int,
            num_kv_heads: int, head_dim: int, min_time_s: float = 1.0) -> dict:
    torch.manual_seed(0)
    blocks_per_req = -(-context_len // BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    table = (torch.randperm(num_blocks - 1)[: num_reqs * blocks_per_req] + 1).view(num_reqs, blocks_per_req)
    seq_lens = [context_len] * num_reqs
    slots = torch.tensor([int(table[i, (context_len - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (context_len - 1) % BLOCK_SIZE
                          for i in range(num_reqs)])
    common = CommonAttentionMetadata(torch.arange(num_reqs + 1), torch.tensor(seq_lens), slots, table, BLOCK_SIZE,
                                     [1] * num_reqs, seq_lens)
    query = torch.randn(num_reqs, num_heads, head_dim).to(dtype)
    key = cache[0].view(-1, num_kv_heads, head_dim)[slots].clone()
    value = cache[1].view(-1, num_kv_heads, head_dim)[slots].clone()
    scale = head_dim**-0.5
    cpu, reference = CpuAttentionBackend(kernel), TorchAttentionBackend()
    cpu_metadata = cpu.build_metadata(common)
    expected = reference.forward(query, key, value, cache.clone(), reference.build_metadata(common), scale)
    out = cpu.forward(query, key, value, cache, cpu_metadata, scale)
    max_diff = float((out.float() - expected.float()).abs().max())
    num_calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time_s:
        cpu.attend(query, key, value, cache, cpu_metadata, scale)
        num_calls += 1
    call_ms = (time.perf_counter() - start) / num_calls * 1e3
    kv_bytes = 2 * num_reqs * context_len * num_kv_heads * head_dim * cache.element_size()
    return {"dtype": str(dtype).removeprefix("torch."), "num_reqs": num_reqs, "context_len": context_len,
            "call_ms": call_ms, "kv_gb_per_s": kv_bytes / call_ms / 1e6, "max_diff_vs_torch": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1x280,64x280,32x1000", help="comma list of REQUESTSxCONTEXT")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    parser.add_argument("--march", default="native")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention_bench.json"))
    args = parser.parse_args()
    os.environ["SPINDLE_CPU_KERNEL_MARCH"] = args.march
    library = load_cpu_kernels()
    if library is None:
        raise SystemExit("the CPU kernels could not be built or loaded (see the log)")
    kernel = PagedDecodeKernel(library)
    num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for shape in args.shapes.split(","):
            num_reqs, context_len = (int(x) for x in shape.split("x"))
            row = measure(kernel, dtype, num_reqs, context_len, num_heads, num_kv_heads, head_dim)
            rows.append(row)
            print(f"{row['dtype']:9s} {num_reqs:4d} requests x {context_len:5d} tokens: {row['call_ms']:7.3f} ms per "
                  f"layer, {row['kv_gb_per_s']:5.1f} GB/s of KV, max diff vs PyTorch {row['max_diff_vs_torch']:.1e}",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"march": args.march, "heads": [num_heads, num_kv_heads, head_dim],
                               "torch_threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
