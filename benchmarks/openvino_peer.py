"""OpenVINO GenAI as a peer: its continuous-batching pipeline driven in-process, as a server drives it.

The driver runs in the peer's venv (benchmarks/peers.py, `openvino`) as a subprocess of the harness:

    benchmarks/.peers/openvino/bin/python -m benchmarks.openvino_peer --model-dir M --variant int8 \
        --ir-root benchmarks/.peers/openvino/ir --workload W.json --levels 1:0:4,8:4:8 --out R.json

1. The model folder (safetensors) is exported once per variant to OpenVINO IR with `optimum-cli export
   openvino`, offline: `bf16` keeps the weights uncompressed (fp32 IR) and runs with the CPU plugin's
   bf16 inference precision; `int8` compresses the weights to int8 (data-free, per channel).
2. One `ContinuousBatchingPipeline` per variant, with a `SchedulerConfig` set as Spindle's scheduler is
   (max_num_seqs, a token budget with chunked prefill, prefix caching).
3. Each level is a closed loop: `c` requests are in the pipeline at all times (a finished one is replaced
   before the next `step()`). Per step the driver reads the new tokens of every open request, and records
   how many requests the pipeline holds and scheduled (`get_metrics()`), so the row shows what ran.
4. A single-stream row (one request, greedy, `--single-stream-tokens` tokens) and a probe of whether
   `max_num_seqs` is in force (c=4 against max_num_seqs=2, per scheduling mode: it was not, here, with
   dynamic split-fuse on).

This module imports only the standard library at the top, so the harness (project venv) can use
`summarize_level` without OpenVINO, and the driver (peer venv) runs without the project's packages.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.single_stream import SINGLE_STREAM_MESSAGES, median_figures, single_stream_figures


@dataclass(frozen=True)
class Variant:
    name: str
    weight_format: str  # optimum-cli --weight-format
    inference_precision: str  # the CPU plugin's INFERENCE_PRECISION_HINT
    description: str


VARIANTS = {
    "bf16": Variant("bf16", "fp32", "bf16", "uncompressed weights, bf16 inference precision"),
    "int8": Variant("int8", "int8", "bf16", "int8 weight compression, bf16 inference precision"),
}


@dataclass(frozen=True)
class PipelineSettings:
    max_num_seqs: int = 256  # Spindle's scheduler defaults
    max_num_batched_tokens: int = 2048
    is_dynamic_split_fuse: bool = True
    is_prefix_caching: bool = True
    cache_size_gb: int = 2  # SmolLM2-135M: about 23 KB of bf16 KV per token


# --- the driver side (peer venv) ----------------------------------------------------------------
@dataclass
class RequestRow:
    """One request's timings, with the fields of `benchmarks.loadgen.RequestResult`."""

    index: int
    prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    cancelled: bool = False


@dataclass
class StepStats:
    """What the pipeline held and scheduled, read from `get_metrics()` after every step."""

    num_steps: int = 0
    max_num_open: int = 0  # requests the loop had added and not yet seen finish
    max_num_requests: int = 0  # the pipeline's `requests`
    max_num_scheduled: int = 0  # the pipeline's `scheduled_requests`
    sum_num_scheduled: int = 0

    def record(self, num_open: int, num_requests: int, num_scheduled: int) -> None:
        self.num_steps += 1
        self.max_num_open = max(self.max_num_open, num_open)
        self.max_num_requests = max(self.max_num_requests, num_requests)
        self.max_num_scheduled = max(self.max_num_scheduled, num_scheduled)
        self.sum_num_scheduled += num_scheduled

    def to_dict(self) -> dict:
        mean = self.sum_num_scheduled / self.num_steps if self.num_steps else 0.0
        return {**asdict(self), "mean_num_scheduled": mean}


_FINISH_REASONS = {"LENGTH": "length", "STOP": "stop", "TOOL_CALL": "stop"}
_OPEN_STATUSES = ("RUNNING",)


class ClosedLoop:
    """Keeps `concurrency` requests in a pipeline until the requests run out or the time limit passes.

    `pipe` needs `add_request(id, input_ids, config) -> handle`, `step()` and `get_metrics()`;
    `handle` needs `can_read()`, `read() -> {seq_id: output with generated_ids, finish_reason}`,
    `get_status()` and `cancel()`. Every token read after a step counts at that step's end.
    """

    def __init__(self, pipe, make_input, make_config, clock=time.perf_counter):
        self.pipe, self.make_input, self.make_config, self.clock = pipe, make_input, make_config, clock
        self.num_added = 0  # the pipeline's request ids: unsigned, and never reused across runs

    def run(self, requests: list[dict], concurrency: int, time_limit_s: float | None = None) -> dict:
        t0 = self.clock()
        deadline = None if time_limit_s is None else t0 + time_limit_s
        queue = deque(requests)
        open_: dict[int, tuple] = {}  # request id -> (handle, row, start, last token time)
        rows: list[RequestRow] = []
        stats = StepStats()
        while queue or open_:
            while queue and len(open_) < concurrency:
                r = queue.popleft()
                row = RequestRow(r["index"], r["prompt_tokens"], r["max_tokens"], start_s=self.clock() - t0)
                handle = self.pipe.add_request(self.num_added, self.make_input(r), self.make_config(r))
                open_[self.num_added] = (handle, row, t0 + row.start_s, None)
                self.num_added += 1
            if deadline is not None and self.clock() >= deadline:
                for handle, row, _, _ in open_.values():
                    handle.cancel()
                    row.cancelled = True
                    rows.append(row)
                for r in queue:  # never started: cancelled with nothing made, as the load generator counts them
                    rows.append(RequestRow(r["index"], r["prompt_tokens"], r["max_tokens"], cancelled=True))
                break
            self.pipe.step()
            now = self.clock()
            metrics = self.pipe.get_metrics()
            stats.record(len(open_), metrics.requests, metrics.scheduled_requests)
            for request_id in list(open_):
                handle, row, start, last = open_[request_id]
                last = self._read(handle, row, start, last, now)
                status = handle.get_status().name
                if status in _OPEN_STATUSES:
                    open_[request_id] = (handle, row, start, last)
                    continue
                if status != "FINISHED":  # IGNORED (did not fit), CANCEL, STOP
                    row.error = f"request ended with status {status}"
                row.e2e_s = now - start
                rows.append(row)
                del open_[request_id]
        rows.sort(key=lambda r: r.index)
        return {"concurrency": concurrency, "time_limit_s": time_limit_s, "duration_s": self.clock() - t0,
                "is_truncated": any(r.cancelled for r in rows), "steps": stats.to_dict(),
                "requests": [asdict(r) for r in rows]}

    @staticmethod
    def _read(handle, row: RequestRow, start: float, last: float | None, now: float) -> float | None:
        """Drains the handle's new tokens into `row`; returns the time of its latest token."""
        num_new = 0
        while handle.can_read():
            for output in handle.read().values():
                num_new += len(output.generated_ids)
                reason = _FINISH_REASONS.get(output.finish_reason.name)
                row.finish_reason = reason or row.finish_reason
        if not num_new:
            return last
        row.output_tokens += num_new
        if last is None:
            row.ttft_s = now - start
        else:
            row.itls_s.append(now - last)
        return now


def export_ir(model_dir: Path, ir_root: Path, variant: Variant) -> tuple[Path, float]:
    """Exports `model_dir` once per variant into `ir_root/<variant>`; returns it and the seconds spent."""
    out = ir_root / variant.name
    weights = model_dir / "model.safetensors"
    want = {"model_dir": str(model_dir), "weight_format": variant.weight_format,
            "weights_mtime_ns": weights.stat().st_mtime_ns if weights.exists() else 0}
    stamp = out / ".exported.json"
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out, 0.0
    tmp = ir_root / f".{variant.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ir_root.mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).parent / "optimum-cli"), "export", "openvino", "-m", str(model_dir),
               "--task", "text-generation-with-past", "--weight-format", variant.weight_format, str(tmp)]
    start = time.monotonic()
    with open(ir_root / f"{variant.name}.export.log", "wb") as log:  # offline: the folder has everything
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=1800,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    stamp.write_text(json.dumps(want))
    return out, time.monotonic() - start


def make_pipeline(ir_dir: Path, variant: Variant, settings: PipelineSettings):
    import openvino_genai

    config = openvino_genai.SchedulerConfig()
    config.max_num_seqs = settings.max_num_seqs
    config.max_num_batched_tokens = settings.max_num_batched_tokens
    config.dynamic_split_fuse = settings.is_dynamic_split_fuse
    config.enable_prefix_caching = settings.is_prefix_caching
    config.cache_size = settings.cache_size_gb
    return openvino_genai.ContinuousBatchingPipeline(
        str(ir_dir), config, "CPU", {"INFERENCE_PRECISION_HINT": variant.inference_precision})


def greedy_config(max_tokens: int):
    """Greedy, exactly `max_tokens` tokens (EOS ignored, as `ignore_eos` makes Spindle do)."""
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.ignore_eos = True
    config.do_sample = False
    return config


def tensor_input(request: dict):
    import numpy as np
    import openvino

    return openvino.Tensor(np.asarray([request["prompt_ids"]], dtype=np.int64))


def probe_max_num_seqs(ir_dir: Path, variant: Variant, prompt: dict, max_num_seqs: int = 2,
                       concurrency: int = 4) -> list[dict]:
    """Whether the pipeline schedules more than `max_num_seqs` requests, per scheduling mode."""
    out = []
    for is_split_fuse in (True, False):
        pipe = make_pipeline(ir_dir, variant, PipelineSettings(max_num_seqs=max_num_seqs, cache_size_gb=1,
                                                               is_dynamic_split_fuse=is_split_fuse))
        requests = [{**prompt, "index": i, "max_tokens": 4} for i in range(concurrency)]
        level = ClosedLoop(pipe, tensor_input, lambda r: greedy_config(r["max_tokens"])).run(requests, concurrency)
        peak = level["steps"]["max_num_scheduled"]
        out.append({"dynamic_split_fuse": is_split_fuse, "max_num_seqs": max_num_seqs, "concurrency": concurrency,
                    "max_num_scheduled": peak, "is_in_force": peak <= max_num_seqs})
        del pipe
    return out


def parse_levels(text: str) -> list[tuple[int, int, int]]:
    """`c:offset:count,...` -> [(concurrency, first request, number of requests)]."""
    levels = []
    for item in text.split(","):
        c, offset, count = (int(x) for x in item.split(":"))
        if c < 1 or offset < 0 or count < 1:
            raise ValueError(f"bad level {item!r}: concurrency and count must be >= 1, offset >= 0")
        levels.append((c, offset, count))
    return levels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True, help="Hugging Face safetensors folder")
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--ir-root", required=True, help="exported IR goes to <ir-root>/<variant>")
    parser.add_argument("--workload", required=True, help="JSON: requests (with prompt_ids), warm_up, single_stream")
    parser.add_argument("--levels", default="", help="c:offset:count,... closed-loop levels, in order")
    parser.add_argument("--time-limit-s", type=float)
    parser.add_argument("--max-num-seqs", type=int, default=PipelineSettings.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=PipelineSettings.max_num_batched_tokens)
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                        help="check whether max_num_seqs is in force (two small extra pipelines)")
    parser.add_argument("--single-stream-repeats", type=int, default=3, help="single-stream runs (the median is kept)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import openvino
    import openvino_genai

    variant = VARIANTS[args.variant]
    workload = json.loads(Path(args.workload).read_text())
    ir_dir, export_s = export_ir(Path(args.model_dir), Path(args.ir_root), variant)
    settings = PipelineSettings(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    start = time.monotonic()
    pipe = make_pipeline(ir_dir, variant, settings)
    compile_s = time.monotonic() - start
    loop = ClosedLoop(pipe, tensor_input, lambda r: greedy_config(r["max_tokens"]))
    loop.run([workload["warm_up"]], 1)  # first-call costs: not measured
    result = {"variant": asdict(variant), "settings": asdict(settings), "ir_dir": str(ir_dir),
              "export_s": export_s, "compile_s": compile_s, "openvino": openvino.__version__,
              "openvino_genai": openvino_genai.__version__,
              # not set here: the CPU plugin's defaults, which the pipeline takes: its KV cache precision
              # (u8 on x86) and the group size in which it quantizes activations to int8 on the fly
              # for matmuls on compressed (int8) weights (32; 0 would mean off)
              "kv_cache_precision": openvino.Core().get_property("CPU", "KV_CACHE_PRECISION").get_type_name(),
              "dynamic_quantization_group_size": int(openvino.Core().get_property(
                  "CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE")),
              "num_threads": os.cpu_count(), "levels": []}
    for c, offset, count in parse_levels(args.levels) if args.levels else []:
        load_before = os.getloadavg()[0]
        level = loop.run(workload["requests"][offset:offset + count], c, args.time_limit_s)
        level["loadavg_1m"] = [load_before, os.getloadavg()[0]]
        result["levels"].append(level)
        done = sum(r["output_tokens"] for r in level["requests"])
        print(f"openvino-{variant.name} c={c}: {done / level['duration_s']:.1f} out tok/s, peak "
              f"{level['steps']['max_num_scheduled']} scheduled, {level['steps']['num_steps']} steps", flush=True)
    if workload.get("single_stream"):
        repeats = [single_stream_figures(loop.run([workload["single_stream"]], 1, args.time_limit_s)["requests"][0])
                   for _ in range(args.single_stream_repeats)]
        result["single_stream"] = median_figures(repeats)
        print(f"openvino-{variant.name} single stream: {result['single_stream']}", flush=True)
    if args.probe:
        result["max_num_seqs_probe"] = probe_max_num_seqs(ir_dir, variant, workload["warm_up"])
        print(f"openvino-{variant.name} max_num_seqs probe: {result['max_num_seqs_probe']}", flush=True)
    Path(args.out).write_text(json.dumps(result))


# --- the harness side (project venv) ------------------------------------------------------------
WARM_UP_MESSAGES = [{"role": "user", "content": "Say hello."}]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 may give a BatchEncoding


def driver_workload(requests, tokenizer, single_stream_tokens: int) -> dict:
    """The harness's requests as token ids (its tokenizer is the IR's), plus the warm-up and single stream."""
    def entry(index: int, messages: list[dict], max_tokens: int) -> dict:
        ids = chat_ids(tokenizer, messages)
        return {"index": index, "prompt_ids": ids, "prompt_tokens": len(ids), "max_tokens": max_tokens}

    return {"requests": [entry(r.index, r.messages, r.max_tokens) for r in requests],
            "warm_up": entry(-1, WARM_UP_MESSAGES, 8),
            "single_stream": entry(-2, SINGLE_STREAM_MESSAGES, single_stream_tokens) if single_stream_tokens else None}


def level_spec(plan: list[dict], repeats: int) -> str:
    """The driver's --levels for the plan's concurrency levels, each repeat on its own slice of requests."""
    return ",".join(f"{p['concurrency']}:{p['offset'] + repeat * p['num_requests']}:{p['num_requests']}"
                    for p in plan if p.get("concurrency") for repeat in range(repeats))


def group_levels(raw: dict, plan: list[dict], repeats: int) -> list[list[dict]]:
    """The driver's levels, summarized and grouped per concurrency level of the plan (repeats together)."""
    levels = [p for p in plan if p.get("concurrency")]
    if len(raw["levels"]) != len(levels) * repeats:
        raise ValueError(f"the driver ran {len(raw['levels'])} levels, {len(levels) * repeats} were asked for")
    runs = [summarize_level(level) for level in raw["levels"]]
    for p, run in zip((p for p in levels for _ in range(repeats)), runs):
        if run["summary"]["concurrency"] != p["concurrency"]:
            raise ValueError(f"driver level c={run['summary']['concurrency']} where c={p['concurrency']} was asked for")
    return [runs[i * repeats:(i + 1) * repeats] for i in range(len(levels))]


def summarize_level(level: dict) -> dict:
    """A driver level as `benchmarks.loadgen.run_scenario` returns a scenario: {"summary", "requests"}."""
    from benchmarks.loadgen import RequestResult, summarize

    results = [RequestResult(**row, usage_tokens=None if row["cancelled"] else row["output_tokens"],
                             saw_done=row["e2e_s"] is not None) for row in level["requests"]]
    summary = summarize(results, level["duration_s"], len(results))
    summary.update(mode="concurrency", concurrency=level["concurrency"], rate=None,
                   time_limit_s=level["time_limit_s"], is_truncated=level["is_truncated"],
                   loadavg_1m=level.get("loadavg_1m"), scheduler=level["steps"])
    return {"summary": summary, "requests": [asdict(r) | {"complete": r.complete} for r in results]}


if __name__ == "__main__":
    main()
