"""Kernel benchmark on a CUDA device: achieved bandwidth against the device's measured copy
bandwidth, sampling latency, and tiled prefill attention against PyTorch's
scaled_dot_product_attention on the same shapes. Prints tables and writes JSON.

Goals (issue 5): paged-attention decode at >= 70% of measured copy bandwidth at batch 64 x
context 2048 (head 128, GQA 8:1, bf16 cache); sampling over a 128k vocabulary at batch 256 under
100 us. Prefill has no goal yet: the table reports both kernels' TFLOP/s (causal: half the
score matrix).

usage: python scripts/bench_kernels.py [--json build/bench/kernels.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.worker.kernels import sampling_ops  # noqa: E402
from services.worker.kernels.attention_ops import group_tile, paged_attention, plan_partitions  # noqa: E402
from services.worker.kernels.loader import CupyLauncher  # noqa: E402
from services.worker.kernels.prefill_attention_ops import (  # noqa: E402
    plan_prefill_tiles,
    prefill_attention,
    tile_plan_tensor,
)


def time_us(fn, iters: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def copy_bandwidth_gbs(num_bytes: int = 2**30) -> float:
    """Device-to-device copy: bytes read plus bytes written per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters=20)
    return 2 * num_bytes / us / 1e3


def bench_decode(launcher, batch=64, context=2048, num_heads=64, num_kv_heads=8, head_dim=128,
                 dtype=torch.bfloat16, block_size=16) -> list[dict]:
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks - 1, device="cuda") + 1  # scattered blocks
    block_table = perm.view(batch, blocks_per_seq).to(torch.int64).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int64, device="cuda")
    query = torch.randn(batch, num_heads, head_dim, device="cuda").to(dtype)
    out = torch.empty(batch, num_heads * head_dim, device="cuda", dtype=dtype)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * cache.element_size()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_ctas = batch * num_kv_heads * -(-(num_heads // num_kv_heads) // group_tile(num_heads, num_kv_heads))
    planned = plan_partitions(context, num_ctas, num_sms)
    rows = []
    for partitions in sorted({1, planned, 8}):
        launches = paged_attention(out, query, cache, block_table, query_start_loc, seq_lens, head_dim**-0.5,
                                   context, partitions)

        def run():
            for launch in launches:
                launcher(launch)

        us = time_us(run)
        rows.append(dict(kernel="paged_attention decode", partitions=partitions, planned=partitions == planned,
                         batch=batch, context=context, heads=f"{num_heads}/{num_kv_heads}", head_dim=head_dim,
                         dtype=str(dtype).removeprefix("torch."), us=us, gbs=kv_bytes / us / 1e3))
    return rows


def bench_sampling(launcher, batch=256, vocab_size=131072) -> list[dict]:
    logits = torch.randn(batch, vocab_size, device="cuda") * 3
    out = torch.empty(batch, dtype=torch.int64, device="cuda")
    seeds = torch.arange(batch, dtype=torch.int64, device="cuda")
    offsets = torch.zeros(batch, dtype=torch.int64, device="cuda")

    def col(value, dtype):
        return torch.full((batch,), value, dtype=dtype, device="cuda")

    configs = {"greedy": (0.0, 0, 1.0, 0.0), "temperature": (0.8, 0, 1.0, 0.0), "min_p": (0.8, 0, 1.0, 0.05),
               "top_k=50": (0.8, 50, 1.0, 0.0), "top_p=0.9": (0.8, 0, 0.9, 0.0), "top_k+top_p": (0.8, 50, 0.9, 0.0)}
    rows = []
    for name, (t, k, p, mp) in configs.items():
        launch = sampling_ops.sample_rows(out, logits, col(t, torch.float32), col(k, torch.int32),
                                          col(p, torch.float32), col(mp, torch.float32), seeds, offsets)
        us = time_us(lambda: launcher(launch))
        rows.append(dict(kernel=f"sample_rows {name}", batch=batch, vocab=vocab_size, us=us,
                         gbs=logits.numel() * 4 / us / 1e3))
    return rows


# (prompts, context already cached, query tokens each): fresh prompts, then a chunk after a context.
PREFILL_SHAPES = ((8, 0, 1024), (1, 0, 4096), (4, 2048, 512))


def bench_prefill(launcher, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                  block_size=16) -> list[dict]:
    """prefill_attention over a paged cache against SDPA on dense [B, H, L, D] copies of the same
    values (K/V expanded to every query head beforehand; a chunk gets an explicit causal mask)."""
    import torch.nn.functional as F

    rows = []
    group = num_heads // num_kv_heads
    for num_prompts, context, query_len in PREFILL_SHAPES:
        seq_len = context + query_len
        blocks_per_seq = -(-seq_len // block_size)
        num_blocks = num_prompts * blocks_per_seq + 1
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda").to(dtype)
        block_table = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(num_prompts, blocks_per_seq)
        query_start_loc = torch.arange(num_prompts + 1, dtype=torch.int64, device="cuda") * query_len
        seq_lens = torch.full((num_prompts,), seq_len, dtype=torch.int64, device="cuda")
        query = torch.randn(num_prompts * query_len, num_heads, head_dim, device="cuda").to(dtype)
        out = torch.empty(num_prompts * query_len, num_heads * head_dim, device="cuda", dtype=dtype)
        plan = tile_plan_tensor(plan_prefill_tiles([query_len] * num_prompts, group), "cuda")
        launch = prefill_attention(out, query, cache, block_table.to(torch.int64).contiguous(), query_start_loc,
                                   seq_lens, plan, head_dim**-0.5)
        ours_us = time_us(lambda: launcher(launch), iters=20)

        # the same keys/values, dense: [B, H, seq_len, D]
        slots = (block_table[:, :, None] * block_size + torch.arange(block_size, device="cuda")).flatten(1)[:, :seq_len]
        k = cache[0].view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2).repeat_interleave(group, dim=1)
        v = cache[1].view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2).repeat_interleave(group, dim=1)
        q = query.view(num_prompts, query_len, num_heads, head_dim).transpose(1, 2)
        if context == 0:
            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim**-0.5)
        else:
            positions = torch.arange(context, seq_len, device="cuda")[:, None]
            mask = torch.arange(seq_len, device="cuda")[None, :] <= positions

            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim**-0.5)
        sdpa_us = time_us(sdpa, iters=20)
        max_error = float((out.view_as(query).transpose(0, 1).float()
                           - sdpa().transpose(1, 2).reshape_as(query).transpose(0, 1).float()).abs().max())
        # causal work: query i sees context + i + 1 keys; 4 flops per (query, key, dim) for QK^T and PV
        flops = 4 * num_prompts * num_heads * head_dim * sum(context + i + 1 for i in range(query_len))
        rows.append(dict(kernel="prefill_attention", prompts=num_prompts, context=context, query_len=query_len,
                         heads=f"{num_heads}/{num_kv_heads}", head_dim=head_dim,
                         dtype=str(dtype).removeprefix("torch."), us=ours_us, sdpa_us=sdpa_us,
                         tflops=flops / ours_us / 1e6, sdpa_tflops=flops / sdpa_us / 1e6, max_error=max_error))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="build/bench/kernels.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    launcher = CupyLauncher()
    device = torch.cuda.get_device_name(0)
    copy_gbs = copy_bandwidth_gbs()
    rows = bench_decode(launcher) + bench_sampling(launcher)
    print(f"device: {device}; measured copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'kernel':34} {'config':28} {'time us':>9} {'GB/s':>7} {'% copy':>7}")
    for r in rows:
        config = (f"P={r['partitions']}{'*' if r['planned'] else ''} b{r['batch']} ctx{r['context']}"
                  if "context" in r else f"b{r['batch']} vocab{r['vocab']}")
        print(f"{r['kernel']:34} {config:28} {r['us']:9.1f} {r['gbs']:7.0f} {100 * r['gbs'] / copy_gbs:6.1f}%")
    prefill = bench_prefill(launcher)
    print(f"{'prefill (paged, bf16, 32/8 heads, d128)':40} {'ours us':>9} {'TFLOP/s':>8} {'sdpa us':>9} "
          f"{'TFLOP/s':>8} {'max err':>8}")
    for r in prefill:
        config = f"{r['prompts']} x (ctx {r['context']} + {r['query_len']})"
        print(f"{config:40} {r['us']:9.1f} {r['tflops']:8.1f} {r['sdpa_us']:9.1f} {r['sdpa_tflops']:8.1f} "
              f"{r['max_error']:8.4f}")
    decode = next(r for r in rows if r.get("planned"))
    sampling = [r for r in rows if r["kernel"].startswith("sample_rows")]
    goals = {
        "decode_fraction_of_copy_bandwidth": decode["gbs"] / copy_gbs,
        "decode_goal_met": decode["gbs"] / copy_gbs >= 0.70,
        "sampling_worst_us": max(r["us"] for r in sampling),
        "sampling_goal_met": all(r["us"] < 100 for r in sampling),
    }
    print(f"goals: decode at {100 * goals['decode_fraction_of_copy_bandwidth']:.0f}% of copy bandwidth "
          f"(goal 70%: {'met' if goals['decode_goal_met'] else 'NOT met'}); sampling worst "
          f"{goals['sampling_worst_us']:.0f} us (goal < 100 us: {'met' if goals['sampling_goal_met'] else 'NOT met'})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(device=device, copy_gbs=copy_gbs, rows=rows, prefill=prefill,
                                               goals=goals), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
