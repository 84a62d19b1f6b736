"""Structured outputs: output tokens/s with a JSON schema on every request against none, same server.

One Spindle server (the dtype this CPU runs best), the same 64 chat requests each round at
concurrency 32, greedy, alternating unconstrained and constrained rounds. Every constrained
request carries one `response_format` json_schema, so the worker compiles it once: a lone
constrained request before the rounds pays that compile, and its TTFT is reported against a lone
unconstrained one. A constrained output ends where its grammar does (EOS is allowed only there), so
`ignore_eos` cannot fix its length; instead one unmeasured constrained pass records each request's
output length, and in the unconstrained rounds that request asks for exactly that many tokens
(`ignore_eos`): both kinds then generate (nearly) the same tokens per request, and the figure
compared is output tokens/s from `usage.completion_tokens`. Every constrained output is checked
with jsonschema; one cut by `max_tokens` is counted apart from one that fails.

    .venv/bin/python -m benchmarks.structured_outputs [--num-rounds 3] [--profile auto]

With `--profile auto` (the default), when constrained keeps less than `--goal` of unconstrained
tokens/s, one more round of each kind runs under py-spy on the worker and its samples are split into
grammar matching, the bitmask kernel, sampling, the model and the rest.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.loadgen import RequestResult, Target, chat_body, send_chat, summarize
from benchmarks.repeats import log
from benchmarks.run import machine_info, warm_up_request
from benchmarks.servers import LOG_DIR, RESULTS_DIR, SpindleServer
from benchmarks.workload import ChatRequest, count_prompt_tokens, load_default_tokenizer

TOPICS = ("fruits", "tools in a garden shed", "rivers of Europe", "kitchen utensils", "birds", "board games",
          "musical instruments", "planets", "trees", "sports", "vegetables", "cities of Asia", "flowers",
          "breeds of dog", "colours", "spices")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
ROOT = Path(__file__).resolve().parents[1]
STATS_POLL_S = 0.25
PROFILE_DELAY_S = 4.0
# Profile frames (py-spy names them `Class.method`), the innermost that names a category wins.
PROFILE_CATEGORIES = (
    ("fill_next_token_bitmask", ("GrammarMatcher.fill_next_token_bitmask",)),
    ("accept_token", ("GrammarMatcher.accept_token", "GrammarMatcher.rollback", "GrammarState.accept",
                      "GrammarState.sync_to")),
    ("bitmask kernel", ("CpuTokenBitmask.__call__", "apply_token_bitmask_cpu", "TorchSampler.apply_token_bitmask")),
    ("other grammar work", ("GrammarBitmask.fill", "ModelRunner._apply_grammars")),
    ("sampling", ("ModelRunner._sample", "build_sampling_metadata")),
    ("model forward", ("forward",)),
    ("rest of execute_model", ("ModelRunner.execute_model",)),
)


def inventory_schema(num_items: int = 4, max_name_chars: int = 16, max_note_chars: int = 24) -> dict:
    """An object holding exactly `num_items` items of bounded strings and a small count: long enough
    output to measure, bounded (each string token is at least one character) below the cap."""
    item = {"type": "object", "additionalProperties": False, "required": ["name", "note", "count"],
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": max_name_chars},
                           "note": {"type": "string", "minLength": 1, "maxLength": max_note_chars},
                           "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
    return {"type": "object", "additionalProperties": False, "required": ["items"],
            "properties": {"items": {"type": "array", "minItems": num_items, "maxItems": num_items, "items": item}}}


def build_requests(tokenizer, num_requests: int, num_items: int, max_tokens: int) -> list[ChatRequest]:
    """The same chat requests for both kinds of round, one topic each (cycled)."""
    requests = []
    for i in range(num_requests):
        topic = TOPICS[i % len(TOPICS)]
        variant = f" (list {i // len(TOPICS) + 1})" if i >= len(TOPICS) else ""
        messages = [{"role": "user", "content": f"List {num_items} {topic}{variant} as JSON: each with a name, "
                                                f"a short note and a count."}]
        requests.append(ChatRequest(i, messages, max_tokens, count_prompt_tokens(tokenizer, messages), False))
    return requests


def matched_lengths(requests: list[ChatRequest], lengths: dict[int, int]) -> list[ChatRequest]:
    """The requests asking for the output length each had when constrained (at least one token)."""
    return [dataclasses.replace(r, max_tokens=max(1, lengths[r.index])) for r in requests]


def check_outputs(results: list[RequestResult], schema: dict) -> dict:
    """Counts constrained outputs that validate, that were cut by max_tokens, and that fail."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    num_valid, num_cut, failures = 0, 0, []
    for r in results:
        try:
            validator.validate(json.loads(r.text))
            num_valid += 1
            continue
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            why = str(exc).splitlines()[0][:160]
        if r.finish_reason == "length" and not r.error:
            num_cut += 1
        else:
            failures.append(f"request {r.index} ({r.finish_reason or r.error}): {why}")
    return {"num_valid": num_valid, "num_cut_by_max_tokens": num_cut, "num_invalid": len(failures),
            "invalid_examples": failures[:5]}


async def run_round(target: Target, requests: list[ChatRequest], tokenizer, extra: dict, concurrency: int,
                    ) -> tuple[dict, list[RequestResult]]:
    """Sends the requests through a semaphore of `concurrency`; the summary adds the peak in flight
    here and the peak `num_running_reqs` the server's /stats reported while they ran."""
    results: list[RequestResult] = []
    in_flight = {"now": 0, "peak": 0, "server_peak": 0}
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(req: ChatRequest) -> None:
            async with semaphore:
                in_flight["now"] += 1
                in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
                try:
                    await send_chat(session, target.chat_url, chat_body(req, target.model, extra), req, tokenizer,
                                    t0, results)
                finally:
                    in_flight["now"] -= 1

        async def poll_stats() -> None:
            while True:
                async with session.get(target.base_url + "/stats") as resp:
                    running = (await resp.json())["num_running_reqs"]
                in_flight["server_peak"] = max(in_flight["server_peak"], running)
                await asyncio.sleep(STATS_POLL_S)

        poller = asyncio.create_task(poll_stats())
        t0 = time.perf_counter()
        await asyncio.gather(*(one(r) for r in requests))
        duration_s = time.perf_counter() - t0
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    results.sort(key=lambda r: r.index)
    summary = summarize(results, duration_s, len(requests))
    summary.update(concurrency=concurrency, max_in_flight=in_flight["peak"],
                   max_num_running_reqs=in_flight["server_peak"],
                   mean_output_tokens=summary["total_output_tokens"] / max(1, len(results)))
    return summary, results


def round_row(kind: str, index: int, summary: dict, check: dict | None = None) -> dict:
    keys = ("duration_s", "total_output_tokens", "mean_output_tokens", "output_throughput", "num_complete",
            "num_failed", "max_in_flight", "max_num_running_reqs", "errors")
    row = {"kind": kind, "round": index, **{k: summary[k] for k in keys},
           "ttft_ms_p50": summary["ttft_ms"]["p50"], "tpot_ms_p50": summary["tpot_ms"]["p50"]}
    if check is not None:
        row["check"] = check
    return row


def compare(rows: list[dict], goal: float) -> dict:
    """Medians per kind over the measured rounds, and constrained / unconstrained output tok/s."""
    out = {}
    for kind in ("unconstrained", "constrained"):
        mine = [r for r in rows if r["kind"] == kind]
        out[kind] = {"output_throughput_median": statistics.median(r["output_throughput"] for r in mine),
                     "output_throughput_rounds": [r["output_throughput"] for r in mine],
                     "mean_output_tokens_rounds": [r["mean_output_tokens"] for r in mine],
                     "tpot_ms_p50_median": statistics.median(r["tpot_ms_p50"] for r in mine),
                     "max_num_running_reqs": max(r["max_num_running_reqs"] for r in mine)}
    ratio = out["constrained"]["output_throughput_median"] / out["unconstrained"]["output_throughput_median"]
    pairs = [c["output_throughput"] / u["output_throughput"] for u, c in zip(
        [r for r in rows if r["kind"] == "unconstrained"], [r for r in rows if r["kind"] == "constrained"])]
    return {**out, "ratio": ratio, "ratio_per_round": pairs, "goal": goal, "is_goal_met": ratio >= goal}


def categorise_profile(raw: str) -> dict:
    """Shares of py-spy raw samples (`frame;frame;... count` per line) by the innermost frame that
    names a category of PROFILE_CATEGORIES (its qualified name, or its last part for a bare name);
    the rest ("other": gRPC, asyncio, the step codec) is what the worker does around the step."""
    counts: dict[str, int] = {name: 0 for name, _ in PROFILE_CATEGORIES}
    counts["other"] = 0
    for line in raw.splitlines():
        stack, _, num = line.rpartition(" ")
        if not stack or not num.isdigit():
            continue
        functions = [re.sub(r"\s*\(.*\)$", "", frame).strip() for frame in stack.split(";")]
        counts[next((category for function in reversed(functions) for category, names in PROFILE_CATEGORIES
                     if function in names or function.rpartition(".")[2] in names), "other")] += int(num)
    total = sum(counts.values())
    return {"num_samples": total, "shares": {k: v / total if total else 0.0 for k, v in counts.items()}}


def render(result: dict) -> str:
    lines = ["| round | kind | out tok/s | mean out tokens | TPOT p50 ms | TTFT p50 ms | peak running | valid / cut / invalid |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rounds"]:
        check = r.get("check")
        checked = f"{check['num_valid']} / {check['num_cut_by_max_tokens']} / {check['num_invalid']}" if check else "-"
        lines.append(f"| {r['round']} | {r['kind']} | {r['output_throughput']:.1f} | {r['mean_output_tokens']:.1f} | "
                     f"{r['tpot_ms_p50']:.1f} | {r['ttft_ms_p50']:.0f} | {r['max_num_running_reqs']} | {checked} |")
    c = result["comparison"]
    lines.append(f"\nmedian out tok/s: unconstrained {c['unconstrained']['output_throughput_median']:.1f}, "
                 f"constrained {c['constrained']['output_throughput_median']:.1f}; ratio {c['ratio']:.3f} "
                 f"(per round {', '.join(f'{x:.3f}' for x in c['ratio_per_round'])}); goal >= {c['goal']:.2f}: "
                 f"{'met' if c['is_goal_met'] else 'NOT met'}")
    probe = result["compile_probe"]
    lines.append(f"first constrained request (pays the compile): TTFT {probe['constrained_ttft_ms']:.0f} ms against "
                 f"{probe['unconstrained_ttft_ms']:.0f} ms unconstrained")
    for kind, profile in (result.get("profile") or {}).items():
        if profile:
            lines.append(f"worker profile, {kind} round ({profile['num_samples']} samples): "
                         + ", ".join(f"{k} {v:.1%}" for k, v in profile["shares"].items()))
    return "\n".join(lines)


async def profiled_round(target: Target, requests: list[ChatRequest], tokenizer, extra: dict, concurrency: int,
                         pid: int, duration_s: int, out_path: Path) -> dict | None:
    """Runs one round with py-spy recording the worker for `duration_s`, from `PROFILE_DELAY_S` in
    (past the first wave's prefill); returns the categorised samples, or None without py-spy."""
    py_spy = Path(sys.executable).with_name("py-spy")
    if not py_spy.exists():
        log("py-spy not found (.venv/bin/pip install py-spy): no profile")
        return None
    round_task = asyncio.create_task(run_round(target, requests, tokenizer, extra, concurrency))
    await asyncio.sleep(PROFILE_DELAY_S)
    spy = await asyncio.create_subprocess_exec(str(py_spy), "record", "-p", str(pid), "-d", str(duration_s), "-r",
                                               "100", "-f", "raw", "-o", str(out_path),
                                               stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    await round_task
    await spy.wait()
    if spy.returncode != 0 or not out_path.exists():
        log(f"py-spy exited with {spy.returncode}: no profile")
        return None
    return {**categorise_profile(out_path.read_text()), "raw": str(out_path)}


def run(args: argparse.Namespace) -> dict:
    from services.worker.config import cpu_has_native_bf16

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
    tokenizer = load_default_tokenizer()
    schema = inventory_schema(args.num_items)
    constrained_extra = {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "inventory", "schema": schema, "strict": True}}}
    requests = build_requests(tokenizer, args.num_requests, args.num_items, args.max_tokens)
    machine = machine_info()
    flags = set(Path("/proc/cpuinfo").read_text().split())
    server = SpindleServer("spindle-structured-outputs", env={"SPINDLE_DTYPE": dtype}, note=dtype)
    log(f"starting Spindle ({dtype})")
    target = server.start()
    free = {"ignore_eos": True}
    try:
        asyncio.run(run_round(target, [warm_up_request(tokenizer)], tokenizer, free, 1))
        lone = dataclasses.replace(requests[0], max_tokens=1)
        plain, _ = asyncio.run(run_round(target, [lone], tokenizer, free, 1))
        first, _ = asyncio.run(run_round(target, [lone], tokenizer, constrained_extra, 1))
        probe = {"unconstrained_ttft_ms": plain["ttft_ms"]["p50"], "constrained_ttft_ms": first["ttft_ms"]["p50"]}
        log(f"compile probe: TTFT {probe['constrained_ttft_ms']:.0f} ms constrained (first), "
            f"{probe['unconstrained_ttft_ms']:.0f} ms unconstrained")
        summary, results = asyncio.run(run_round(target, requests, tokenizer, constrained_extra, args.concurrency))
        calibration = round_row("constrained", 0, summary, check_outputs(results, schema))
        lengths = {r.index: r.output_tokens for r in results}
        free_requests = matched_lengths(requests, lengths)
        log(f"calibration pass: {summary['mean_output_tokens']:.1f} tokens a request, "
            f"{summary['output_throughput']:.1f} out tok/s")
        rows = []
        for index in range(1, args.num_rounds + 1):
            for kind in ("unconstrained", "constrained"):
                is_free = kind == "unconstrained"
                summary, results = asyncio.run(run_round(target, free_requests if is_free else requests, tokenizer,
                                                         free if is_free else constrained_extra, args.concurrency))
                rows.append(round_row(kind, index, summary, None if is_free else check_outputs(results, schema)))
                log(f"round {index} {kind}: {summary['output_throughput']:.1f} out tok/s, "
                    f"{summary['mean_output_tokens']:.1f} tokens a request, peak running "
                    f"{summary['max_num_running_reqs']}")
        comparison = compare(rows, args.goal)
        profile = None
        if args.profile == "always" or (args.profile == "auto" and not comparison["is_goal_met"]):
            pid = server.cluster.procs["worker"].pid
            profile = {kind: asyncio.run(profiled_round(
                target, free_requests if kind == "unconstrained" else requests, tokenizer,
                free if kind == "unconstrained" else constrained_extra, args.concurrency, pid, args.profile_s,
                LOG_DIR / f"structured_outputs_profile_{kind}.txt")) for kind in ("unconstrained", "constrained")}
    finally:
        server.stop()
    return {
        "command": " ".join([_interpreter(), "-m", "benchmarks.structured_outputs", *sys.argv[1:]]),
        "machine": {**machine, "loadavg_after": list(os.getloadavg())},
        "cpu_flags": [f for f in CPU_FLAGS if f in flags], "dtype": dtype,
        "worker_torch_threads": int(server.info["env"]["SPINDLE_NUM_THREADS"]),
        "args": vars(args), "schema": schema, "compile_probe": probe, "calibration": calibration,
        "rounds": rows, "comparison": comparison, "profile": profile,
        "num_invalid": sum(r["check"]["num_invalid"] for r in rows if "check" in r),
        "num_cut_by_max_tokens": sum(r["check"]["num_cut_by_max_tokens"] for r in rows if "check" in r),
    }


def _interpreter() -> str:
    exe = Path(sys.executable)
    return str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else str(exe)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-rounds", type=int, default=3, help="rounds of each kind, alternating")
    parser.add_argument("--num-items", type=int, default=4, help="items the schema's array holds")
    parser.add_argument("--max-tokens", type=int, default=320, help="constrained cap, above the schema's longest output")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has bfloat16 arithmetic")
    parser.add_argument("--goal", type=float, default=0.9, help="constrained / unconstrained tok/s to keep")
    parser.add_argument("--profile", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("--profile-s", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS_DIR / "structured_outputs.json"))
    result = run(parser.parse_args(argv))
    out = Path(result["args"]["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(render(result))
    log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
