"""Prefill-attention benchmark: the compiled kernel (csrc/paged_prefill.c, every slice of a step in
one call) against PyTorch's SDPA path (one call per slice, `TorchAttentionBackend.attend_prefills`),
one layer's call per shape, bfloat16.

SmolLM2-135M's attention shape by default (9 query heads sharing 3 KV heads of 64, blocks of 16),
block tables scattered over the cache, queries as strided views of the fused qkv output, this
step's K/V already in the cache (as the fused RoPE + cache write leaves them). Reports the median
of 15 calls in milliseconds and GFLOP/s (causal: 4 H D flops per visible query-key pair), and the
largest difference between the two outputs.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.prefill_attention_bench \\
        [--shapes 1x64,1x290,1x1024,1x256@768,7x290] [--heads 9,3,64] [--threads N] [--out F]

A shape is SLICESxQUERY_TOKENS[@CONTEXT_TOKENS].
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.attention.cpu_prefill import PagedPrefillKernel
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.cpu_kernels import _cpu_flags, load_cpu_kernels

BLOCK_SIZE = 16
NUM_CALLS = 15
DEFAULT_SHAPES = "1x64,1x290,1x1024,1x256@768,7x290"


def parse_shape(shape: str) -> tuple[int, int, int]:
    """'7x290' -> (7, 290, 0); '1x256@768' -> (1, 256, 768)."""
    slices, rest = shape.split("x")
    query_len, _, context_len = rest.partition("@")
    return int(slices), int(query_len), int(context_len or 0)


def make_step(num_slices: int, query_len: int, context_len: int, num_heads: int, num_kv_heads: int, head_dim: int):
    """A step of `num_slices` equal prefill slices over scattered blocks: common metadata, q/k/v
    views of one fused projection output, and the cache holding context and this step's K/V."""
    gen = torch.Generator().manual_seed(0)
    seq_len = context_len + query_len
    blocks_per_slice = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_slices * blocks_per_slice + 1
    table = (torch.randperm(num_blocks - 1, generator=gen)[: num_slices * blocks_per_slice] + 1).view(num_slices, -1)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    positions = torch.arange(context_len, seq_len)
    slots = torch.cat([table[i, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
                       for i in range(num_slices)])
    num_tokens = num_slices * query_len
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    query = q.view(num_tokens, num_heads, head_dim)
    key, value = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    cache[0].view(-1, num_kv_heads, head_dim)[slots] = key
    cache[1].view(-1, num_kv_heads, head_dim)[slots] = value
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(num_slices + 1) * query_len, seq_lens=torch.full((num_slices,), seq_len),
        slot_mapping=slots, block_table=table, block_size=BLOCK_SIZE, query_lens_cpu=[query_len] * num_slices,
        seq_lens_cpu=[seq_len] * num_slices)
    return common, query, key, value, cache


def median_ms(call) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(NUM_CALLS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(backends: dict[str, TorchAttentionBackend], shape: str, num_heads: int, num_kv_heads: int,
            head_dim: int) -> dict:
    num_slices, query_len, context_len = parse_shape(shape)
    common, query, key, value, cache = make_step(num_slices, query_len, context_len, num_heads, num_kv_heads,
                                                 head_dim)
    scale = head_dim**-0.5
    pairs = num_slices * (query_len * context_len + query_len * (query_len + 1) // 2)
    gflop = 4 * num_heads * head_dim * pairs / 1e9
    row = {"shape": shape, "num_slices": num_slices, "query_len": query_len, "context_len": context_len,
           "gflop": gflop}
    outputs = {}
    for name, backend in backends.items():
        metadata = backend.build_metadata(common)  # once per step, as the model runner does
        out = torch.empty(query.shape[0], num_heads * head_dim, dtype=torch.bfloat16)

        def call(backend=backend, metadata=metadata, out=out):
            backend.attend_prefills(query, key, value, cache[0], cache[1], metadata, scale, out)

        ms = median_ms(call)
        outputs[name] = out
        row[f"{name}_ms"], row[f"{name}_gflop_per_s"] = ms, gflop / ms * 1e3
    row["speedup"] = row["sdpa_ms"] / row["kernel_ms"]
    row["max_diff"] = float((outputs["kernel"].float() - outputs["sdpa"].float()).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of SLICESxQUERY_TOKENS[@CONTEXT]")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_attention_bench.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    library = load_cpu_kernels()
    if library is None:
        raise SystemExit("the CPU kernels could not be built or loaded (see the log)")
    num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    prefill_kernel = PagedPrefillKernel(library)
    if not prefill_kernel.supports(torch.bfloat16, head_dim, num_heads, num_kv_heads):
        raise SystemExit("no prefill kernel here (it needs a CPU with AVX512_BF16) or for these heads")
    decode_kernel = PagedDecodeKernel(library)
    backends = {"kernel": CpuAttentionBackend(decode_kernel, prefill_kernel), "sdpa": TorchAttentionBackend()}
    print(f"{'shape':12s} {'GFLOP':>7s} {'kernel ms':>10s} {'GFLOP/s':>8s} {'SDPA ms':>9s} {'GFLOP/s':>8s} "
          f"{'speedup':>8s} {'max diff':>9s}")
    rows = []
    for shape in args.shapes.split(","):
        row = measure(backends, shape, num_heads, num_kv_heads, head_dim)
        rows.append(row)
        print(f"{shape:12s} {row['gflop']:7.3f} {row['kernel_ms']:10.3f} {row['kernel_gflop_per_s']:8.1f} "
              f"{row['sdpa_ms']:9.3f} {row['sdpa_gflop_per_s']:8.1f} {row['speedup']:7.1f}x {row['max_diff']:9.1e}",
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    flags = sorted(_cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    out.write_text(json.dumps({"heads": [num_heads, num_kv_heads, head_dim], "block_size": BLOCK_SIZE,
                               "threads": args.threads, "num_calls": NUM_CALLS, "cpu_flags": flags,
                               "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
