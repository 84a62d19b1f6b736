"""Tensor parallelism's cost, in one run:

1. **step overhead**: the served fake-model engine (benchmarks/engine_overhead.py) at 64 and 256
   running requests with one worker rank and with two (each step encoded once, sent to both ranks,
   both answers read; the fake ranks run no collectives, so this is the fan-out alone);
2. **bfloat16 c=32**: output tok/s of the embedded model under the benchmark workload at TP=1 (one
   worker, every core) and TP=2 (two workers, one core each), on the same seeded requests;
3. **vocabulary**: on two gloo ranks of one thread each, the LM head at 32 decode rows replicated
   (rank 0 alone) against split by vocabulary (each rank half, the halves gathered to rank 0), and
   the embedding of 32 and 2,048 tokens replicated against split (masked lookup + all-reduce).

    .venv/bin/python -m benchmarks.tensor_parallel [--levels 64,256] [--num-requests 64]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.engine_overhead import fake_cluster_env, measure_served
from benchmarks.loadgen import run_scenario
from benchmarks.servers import SpindleServer
from benchmarks.workload import WorkloadSpec, build_workload, load_default_tokenizer
from tests.e2e.cluster import free_port

VOCAB_SIZE, HIDDEN_SIZE = 49152, 576  # SmolLM2-135M
NUM_REPEATS = 50


def step_overhead(levels: list[int], tp: int) -> list[dict]:
    server = SpindleServer(f"spindle-fake-tp{tp}", env=fake_cluster_env(max(levels)), tensor_parallel_size=tp)
    target = server.start()
    pids = {name: proc.pid for name, proc in server.cluster.procs.items()}
    try:
        return [asyncio.run(measure_served(target.base_url, target.model, pids, n, window_s=2.0, num_windows=3))
                for n in levels]
    finally:
        server.stop()


def bf16_throughput(tp: int, num_requests: int, tokenizer) -> dict:
    env = {"SPINDLE_DTYPE": "bfloat16", "SPINDLE_NUM_THREADS": "2" if tp == 1 else "1"}
    server = SpindleServer(f"spindle-bf16-tp{tp}", env=env, tensor_parallel_size=tp)
    requests = build_workload(WorkloadSpec(num_requests=num_requests, seed=0), tokenizer)
    target = server.start()
    try:
        asyncio.run(run_scenario(target, requests[:2], tokenizer, concurrency=2))  # warm-up
        return asyncio.run(run_scenario(target, requests, tokenizer, concurrency=32))["summary"]
    finally:
        server.stop()


def _median_ms(fn) -> float:
    times = []
    for _ in range(NUM_REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _vocab_rank(rank: int, port: int, dtype_name: str, out) -> None:
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, 2, options)
    torch.manual_seed(0)
    weight = torch.randn(VOCAB_SIZE, HIDDEN_SIZE, dtype=dtype)
    half = VOCAB_SIZE // 2
    shard = weight[rank * half:(rank + 1) * half].contiguous()
    rows = torch.randn(32, HIDDEN_SIZE, dtype=dtype)
    results = {}

    def barrier():
        group.allreduce([torch.zeros(1)]).wait()

    def replicated_head():
        if rank == 0:
            torch.nn.functional.linear(rows, weight)
        barrier()

    def split_head():
        part = torch.nn.functional.linear(rows, shard).float()  # gathered in float32, as the sampler takes it
        parts = [torch.empty_like(part) for _ in range(2)]
        group.allgather([parts], [part]).wait()
        if rank == 0:
            torch.cat(parts, dim=1)

    results["lm_head_replicated_ms"] = _median_ms(replicated_head)
    results["lm_head_vocab_parallel_ms"] = _median_ms(split_head)
    for num_tokens in (32, 2048):
        ids = torch.randint(0, VOCAB_SIZE, (num_tokens,))

        def replicated_embed():
            torch.nn.functional.embedding(ids, weight)
            barrier()

        def split_embed():
            local = ids - rank * half
            mask = (local < 0) | (local >= half)
            x = torch.nn.functional.embedding(local.masked_fill(mask, 0), shard)
            x.masked_fill_(mask.unsqueeze(1), 0)
            group.allreduce([x]).wait()

        results[f"embedding_{num_tokens}_replicated_ms"] = _median_ms(replicated_embed)
        results[f"embedding_{num_tokens}_vocab_parallel_ms"] = _median_ms(split_embed)
    if rank == 0:
        out.put(results)


def vocabulary(dtype_name: str) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_vocab_rank, args=(rank, port, dtype_name, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=600)
    for proc in procs:
        proc.join(60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="64,256")
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the c=32 run")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M")}
    out["vocabulary"] = {dtype: vocabulary(dtype) for dtype in ("float32", "bfloat16")}
    print(json.dumps(out["vocabulary"], indent=1), flush=True)
    out["step_overhead"] = {f"tp{tp}": step_overhead(levels, tp) for tp in (1, 2)}
    for tp, rows in out["step_overhead"].items():
        for row in rows:
            print(f"{tp} {row['num_running']:4d} running: {row['step_ms']:.2f} ms/step", flush=True)
    tokenizer = load_default_tokenizer()
    out["bf16_c32"] = {f"tp{tp}": bf16_throughput(tp, args.num_requests, tokenizer) for tp in (1, 2)}
    for tp, summary in out["bf16_c32"].items():
        print(f"bfloat16 c=32 {tp}: {summary['output_throughput']:.1f} output tok/s", flush=True)
    path = Path(__file__).parent / "results" / "tensor_parallel.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
