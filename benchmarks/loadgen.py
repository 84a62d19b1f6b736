"""The load generator: streaming OpenAI chat requests over HTTP, as `vllm bench serve` sends them.

Two arrival patterns over the same request list:
- fixed concurrency: `concurrency` clients, each sending its next request when the last one ends;
- Poisson: requests start at exponential intervals of mean 1/rate (seeded), however many are open.

Per request it records the time to the first content token (TTFT), the gaps between content
chunks (inter-token latency, ITL), the end-to-end latency, the output token count (the server's
`usage` when it sends one, else the text re-tokenized with the model's tokenizer) and whether the
response was complete: a finish reason, no error object, and the stream's end. A scenario may have
a time limit: requests still open then are cancelled and counted as such (their tokens count for
throughput, their latencies do not count as complete ones).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from benchmarks.workload import ChatRequest


@dataclass
class RequestResult:
    index: int
    prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0  # from the scenario's start
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    usage_tokens: int | None = None  # what the server reported, if it did
    finish_reason: str | None = None
    saw_done: bool = False
    error: str = ""
    cancelled: bool = False
    text: str = ""

    @property
    def complete(self) -> bool:
        return not self.error and not self.cancelled and self.finish_reason in ("stop", "length")


async def send_chat(session: aiohttp.ClientSession, url: str, body: dict, req: ChatRequest, tokenizer,
                    t0: float, results: list[RequestResult]) -> None:
    """Sends one streaming chat request and appends its result to `results` (also when cancelled)."""
    result = RequestResult(req.index, req.prompt_tokens, req.max_tokens)
    start = time.perf_counter()
    result.start_s = start - t0
    last = None
    pieces: list[str] = []
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    result.saw_done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    continue
                if chunk.get("usage"):
                    result.usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft_s = now - start
                        else:
                            result.itls_s.append(now - last)
                        last = now
                        pieces.append(content)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
        result.e2e_s = time.perf_counter() - start
    except asyncio.CancelledError:
        result.cancelled = True
        raise
    except (aiohttp.ClientError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result.text = "".join(pieces)
        if result.usage_tokens and not result.cancelled:
            result.output_tokens = result.usage_tokens
        else:  # only then: tokenizing every reply takes CPU from the server under test on the same cores
            result.output_tokens = len(tokenizer.encode(result.text, add_special_tokens=False)) if result.text else 0
        results.append(result)


def chat_body(req: ChatRequest, model: str, extra: dict | None = None) -> dict:
    """Greedy, streamed, usage asked for; `extra` adds fields, and a None value drops one."""
    body = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    return {k: v for k, v in body.items() if v is not None}


@dataclass(frozen=True)
class Target:
    """Where to send requests and what each server needs in the body (None: leave the field out)."""

    base_url: str
    model: str
    extra_body: dict = field(default_factory=dict)

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"


async def run_scenario(target: Target, requests: list[ChatRequest], tokenizer, *, concurrency: int | None = None,
                       rate: float | None = None, seed: int = 0, time_limit_s: float | None = None) -> dict:
    """Runs the requests at a fixed concurrency or a Poisson rate; returns the summary and the per-request rows."""
    assert (concurrency is None) != (rate is None), "give a concurrency or a rate"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    results: list[RequestResult] = []
    load_before = os.getloadavg()[0]
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        async def one(req: ChatRequest) -> None:
            await send_chat(session, target.chat_url, chat_body(req, target.model, target.extra_body),
                            req, tokenizer, t0, results)

        if concurrency is not None:
            queue = list(reversed(requests))

            async def client() -> None:
                while queue:
                    await one(queue.pop())

            tasks = [asyncio.create_task(client()) for _ in range(min(concurrency, len(requests)))]
        else:
            rng = random.Random(seed)

            async def arrivals() -> None:
                for req in requests:
                    tasks.append(asyncio.create_task(one(req)))
                    await asyncio.sleep(rng.expovariate(rate))

            tasks = [asyncio.create_task(arrivals())]
        deadline = None if time_limit_s is None else t0 + time_limit_s
        pending: set = set()
        while True:  # Poisson arrivals add tasks while we wait
            current = set(tasks)
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            _, pending = await asyncio.wait(current, timeout=left)
            if not pending and len(tasks) == len(current):
                break
            if pending and deadline is not None and time.perf_counter() >= deadline:
                break
        for task in pending:  # the time limit: open requests record themselves as cancelled
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        duration_s = time.perf_counter() - t0
    results.sort(key=lambda r: r.index)
    summary = summarize(results, duration_s, len(requests))
    summary.update(mode="concurrency" if concurrency is not None else "rate",
                   concurrency=concurrency, rate=rate, time_limit_s=time_limit_s, is_truncated=bool(pending),
                   loadavg_1m=[load_before, os.getloadavg()[0]])
    return {"summary": summary, "requests": [_row(r) for r in results]}


def _row(r: RequestResult) -> dict:
    row = asdict(r)
    row["complete"] = r.complete
    row["text"] = r.text[:80]
    return row


def percentiles(values: list[float], scale: float = 1e3) -> dict:
    """p50/p90/p99 and mean, in milliseconds by default; None when there are no values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered) * scale, "p50": pct(50) * scale, "p90": pct(90) * scale,
            "p99": pct(99) * scale}


def summarize(results: list[RequestResult], duration_s: float, num_planned: int) -> dict:
    complete = [r for r in results if r.complete]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in complete
             if r.output_tokens > 1 and r.ttft_s is not None]
    total_output = sum(r.output_tokens for r in results)
    return {
        "num_planned": num_planned,
        "num_complete": len(complete),
        "num_failed": sum(1 for r in results if r.error or (not r.cancelled and not r.complete)),
        "num_cancelled": sum(1 for r in results if r.cancelled),
        "is_all_complete": len(complete) == num_planned,
        "num_at_max_tokens": sum(1 for r in complete if r.output_tokens >= r.max_tokens),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in results),
        "total_output_tokens": total_output,
        "request_throughput": len(complete) / duration_s if duration_s else 0.0,
        "output_throughput": total_output / duration_s if duration_s else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in results if r.ttft_s is not None]),
        "itl_ms": percentiles([x for r in results for x in r.itls_s]),
        "tpot_ms": percentiles(tpots),
        "e2e_ms": percentiles([r.e2e_s for r in complete]),
    }
