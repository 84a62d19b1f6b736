"""The single-stream row: one chat request at a time, greedy, a forced number of tokens, repeated;
tok/s over the request and decode tok/s after its first token, the median repeat by tok/s.

The same figures for every server: HTTP servers through the load generator (streamed, so TTFT is
the first content chunk), in-process peers (OpenVINO GenAI) from their driver's request rows.
"""
from __future__ import annotations

import asyncio
import statistics

SINGLE_STREAM_MESSAGES = [{"role": "user", "content": "Tell me a long story about a library."}]


def single_stream_figures(row: dict) -> dict:
    """tok/s over the whole request, and decode tok/s after the first token, from one request row
    (output_tokens, e2e_s, ttft_s)."""
    n, e2e, ttft = row["output_tokens"], row["e2e_s"], row["ttft_s"]
    return {"num_tokens": n, "e2e_s": e2e, "ttft_ms": ttft * 1e3 if ttft is not None else None,
            "tok_s": n / e2e if e2e else None,
            "decode_tok_s": (n - 1) / (e2e - ttft) if e2e and ttft is not None and n > 1 and e2e > ttft else None}


def median_figures(repeats: list[dict]) -> dict:
    """The repeat with the median tok/s, with every repeat's tok/s kept beside it."""
    measured = [r for r in repeats if r["tok_s"] is not None]
    if not measured:
        return {**repeats[0], "num_repeats": len(repeats), "repeats_tok_s": []}
    by_speed = sorted(measured, key=lambda r: r["tok_s"])
    median = dict(by_speed[(len(by_speed) - 1) // 2])
    median["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in measured if r["decode_tok_s"] is not None) \
        if any(r["decode_tok_s"] is not None for r in measured) else None
    return {**median, "num_repeats": len(repeats), "repeats_tok_s": [r["tok_s"] for r in repeats]}


def single_stream_request(tokenizer, num_tokens: int):
    from benchmarks.workload import ChatRequest, count_prompt_tokens

    return ChatRequest(-2, SINGLE_STREAM_MESSAGES, num_tokens, count_prompt_tokens(tokenizer, SINGLE_STREAM_MESSAGES),
                       False)


def run_http(target, tokenizer, num_tokens: int, num_repeats: int, time_limit_s: float | None) -> dict | None:
    """The row for a server behind HTTP; None when no repeat completed with `num_tokens` tokens."""
    from benchmarks.loadgen import run_scenario

    request = single_stream_request(tokenizer, num_tokens)
    repeats = []
    for _ in range(num_repeats):
        run = asyncio.run(run_scenario(target, [request], tokenizer, concurrency=1, time_limit_s=time_limit_s))
        row = run["requests"][0]
        if row["complete"]:
            repeats.append(single_stream_figures(row))
    return median_figures(repeats) if repeats else None
