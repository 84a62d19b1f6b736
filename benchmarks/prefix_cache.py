"""Prefix caching: TTFT of requests that share a 1,000-token prefix, with the cache on and off.

Spindle is started twice (SPINDLE_ENABLE_PREFIX_CACHING=true, then false). Each time one request
primes the cache (not measured), then the measured requests run one at a time (concurrency 1, so
TTFT is the prefill of what was not cached plus the engine's latency). Every request has the same
system prompt of `prefix_tokens` tokens and its own short question.

    .venv/bin/python -m benchmarks.prefix_cache [--num-requests 4] [--prefix-tokens 1000]

`--burst N` measures a cold burst instead: N requests sharing a prefix nobody has sent before, all
at once (concurrency N), with the cache on: how many prompt tokens the cache served, and the
burst's TTFT and duration. Blocks join the cache when their step is scheduled, so requests admitted
beside the first, or while its step runs, already find the prefix.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from benchmarks.loadgen import run_scenario
from benchmarks.servers import SpindleServer
from benchmarks.workload import load_default_tokenizer, shared_prefix_requests


def measure(tokenizer, enable_caching: bool, num_requests: int, prefix_tokens: int, dtype: str,
            time_limit_s: float | None) -> dict:
    requests = shared_prefix_requests(tokenizer, num_requests + 1, prefix_tokens)
    name = f"spindle-prefix-{'on' if enable_caching else 'off'}"
    server = SpindleServer(name, env={"SPINDLE_ENABLE_PREFIX_CACHING": str(enable_caching).lower(),
                                      "SPINDLE_DTYPE": dtype})
    target = server.start()
    try:
        asyncio.run(run_scenario(target, requests[:1], tokenizer, concurrency=1))  # primes the cache
        run = asyncio.run(run_scenario(target, requests[1:], tokenizer, concurrency=1, time_limit_s=time_limit_s))
        stats = server.stats()
    finally:
        server.stop()
    ttfts = [r["ttft_s"] * 1e3 for r in run["requests"] if r["ttft_s"] is not None]
    return {
        "enable_prefix_caching": enable_caching,
        "prompt_tokens": [r.prompt_tokens for r in requests[1:]],
        "ttft_ms": ttfts,
        "ttft_ms_median": statistics.median(ttfts) if ttfts else None,
        "num_complete": run["summary"]["num_complete"],
        "prefix_cache_queries": stats.get("prefix_cache_queries"),
        "prefix_cache_hits": stats.get("prefix_cache_hits"),
    }


def burst(tokenizer, num_requests: int, prefix_tokens: int, dtype: str, env: dict[str, str]) -> dict:
    """`num_requests` requests with one new shared prefix, sent at once to a fresh server."""
    requests = shared_prefix_requests(tokenizer, num_requests, prefix_tokens, seed=11)
    server = SpindleServer("spindle-prefix-burst", env={"SPINDLE_DTYPE": dtype, **env})
    target = server.start()
    try:
        asyncio.run(run_scenario(target, shared_prefix_requests(tokenizer, 1, 64, seed=3), tokenizer, concurrency=1))
        before = server.stats()
        run_ = asyncio.run(run_scenario(target, requests, tokenizer, concurrency=num_requests))
        after = server.stats()
    finally:
        server.stop()
    ttfts = [r["ttft_s"] * 1e3 for r in run_["requests"] if r["ttft_s"] is not None]
    out = {"num_requests": num_requests, "prefix_tokens": prefix_tokens, "dtype": dtype, "env": env,
           "prompt_tokens": sum(r.prompt_tokens for r in requests),
           "cached_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
           "ttft_ms_median": statistics.median(ttfts) if ttfts else None, "ttft_ms_max": max(ttfts, default=None),
           "duration_s": run_["summary"]["duration_s"], "num_complete": run_["summary"]["num_complete"]}
    print(f"cold burst of {num_requests} requests sharing {prefix_tokens} new tokens: {out['cached_tokens']} of "
          f"{out['prompt_tokens']} prompt tokens from the cache, TTFT median {out['ttft_ms_median'] or 0:.0f} ms, "
          f"max {out['ttft_ms_max'] or 0:.0f} ms, {out['duration_s']:.2f} s", flush=True)
    return out


def run(num_requests: int = 4, prefix_tokens: int = 1000, dtype: str = "float32",
        time_limit_s: float | None = None, tokenizer=None) -> dict:
    tokenizer = tokenizer or load_default_tokenizer()
    on = measure(tokenizer, True, num_requests, prefix_tokens, dtype, time_limit_s)
    off = measure(tokenizer, False, num_requests, prefix_tokens, dtype, time_limit_s)
    speedup = (off["ttft_ms_median"] / on["ttft_ms_median"]
               if on["ttft_ms_median"] and off["ttft_ms_median"] else None)
    print(f"prefix cache ({prefix_tokens}-token shared prefix, {num_requests} requests): TTFT median "
          f"on {on['ttft_ms_median'] or float('nan'):.0f} ms, off {off['ttft_ms_median'] or float('nan'):.0f} ms"
          + (f" = {speedup:.1f}x lower with the cache" if speedup else ""), flush=True)
    return {"prefix_tokens": prefix_tokens, "num_requests": num_requests, "dtype": dtype, "on": on, "off": off,
            "ttft_speedup": speedup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--time-limit-s", type=float)
    parser.add_argument("--burst", type=int, default=0, help="measure a cold burst of this many requests instead")
    parser.add_argument("--env", nargs="*", default=[], help="K=V settings for the burst's server")
    args = parser.parse_args()
    if args.burst:
        out = burst(load_default_tokenizer(), args.burst, args.prefix_tokens, args.dtype,
                    dict(kv.split("=", 1) for kv in args.env))
    else:
        out = run(args.num_requests, args.prefix_tokens, args.dtype, args.time_limit_s)
    path = Path(__file__).parent / "results" / ("prefix_burst.json" if args.burst else "prefix_cache.json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
