"""The baseline: Hugging Face `generate()` on static batches, over the same workload.

A closed loop of `batch_size` clients served as static batches: the next batch starts when the
whole previous one has finished (what a server without continuous batching does). Prompts are
left-padded; every request's output is forced to its own `max_tokens` (EOS is masked until then,
as `ignore_eos` does for the servers), and the batch runs until its longest request is done.
Per request: TTFT = first decoding step after the batch's start, ITL = gaps between its steps,
end-to-end = the batch's end (a static batch returns all at once). Runs in its own process:

    .venv/bin/python -m benchmarks.hf_generate --workload W.json --batch-sizes 1,8 --out R.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.loadgen import RequestResult, summarize


class _StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class _Deadline:
    def __init__(self, deadline: float | None):
        self.deadline = deadline

    def __call__(self, input_ids, scores, **kwargs):
        is_over = self.deadline is not None and time.perf_counter() > self.deadline
        return torch.full((input_ids.shape[0],), is_over, dtype=torch.bool)


def run_batches(model, tokenizer, requests: list[dict], batch_size: int, time_limit_s: float | None) -> dict:
    from transformers import LogitsProcessorList, StoppingCriteriaList

    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    deadline = None if time_limit_s is None else t0 + time_limit_s
    results: list[RequestResult] = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        if deadline is not None and time.perf_counter() >= deadline:
            for r in batch:
                results.append(RequestResult(r["index"], r["prompt_tokens"], r["max_tokens"], cancelled=True))
            continue
        texts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        longest = max(r["max_tokens"] for r in batch)
        clock = _StepClock()
        batch_start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           logits_processor=LogitsProcessorList([clock]),
                           stopping_criteria=StoppingCriteriaList([_Deadline(deadline)]),
                           pad_token_id=tokenizer.pad_token_id)
        batch_end = time.perf_counter()
        for r in batch:
            steps = clock.times[:r["max_tokens"]]
            is_done = len(steps) >= r["max_tokens"]
            result = RequestResult(r["index"], r["prompt_tokens"], r["max_tokens"], start_s=batch_start - t0,
                                   ttft_s=steps[0] - batch_start if steps else None,
                                   itls_s=[b - a for a, b in zip(steps, steps[1:])],
                                   output_tokens=len(steps), usage_tokens=len(steps),
                                   e2e_s=batch_end - batch_start if is_done else None,
                                   finish_reason="length" if is_done else None, saw_done=is_done,
                                   cancelled=not is_done)
            results.append(result)
    duration_s = time.perf_counter() - t0
    summary = summarize(results, duration_s, len(requests))
    summary.update(mode="concurrency", concurrency=batch_size, rate=None, time_limit_s=time_limit_s,
                   is_truncated=any(r.cancelled for r in results), loadavg_1m=[load_before, os.getloadavg()[0]])
    return {"summary": summary, "requests": [vars(r) | {"complete": r.complete} for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True, help="JSON list of requests (benchmarks.workload.ChatRequest)")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--num-requests", help="requests per batch size, e.g. 4,16,32,64 (default: all)")
    parser.add_argument("--offsets", help="first request of each batch size in the workload (default: 0)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--time-limit-s", type=float)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.model_files import resolve_model

    path = str(resolve_model(None, None).path)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    requests = json.loads(Path(args.workload).read_text())
    with torch.inference_mode():  # warm-up, not measured
        model.generate(**tokenizer(["Hello"], return_tensors="pt"), max_new_tokens=4, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    counts = [int(x) for x in args.num_requests.split(",")] if args.num_requests else [len(requests)] * len(sizes)
    offsets = [int(x) for x in args.offsets.split(",")] if args.offsets else [0] * len(sizes)
    runs = []
    for size, count, offset in zip(sizes, counts, offsets, strict=True):
        run = run_batches(model, tokenizer, requests[offset:offset + count], size, args.time_limit_s)
        s = run["summary"]
        print(f"hf generate batch {size}: {s['output_throughput']:.1f} tok/s, {s['num_complete']}/{count} complete",
              flush=True)
        runs.append(run)
    Path(args.out).write_text(json.dumps({"torch_threads": torch.get_num_threads(), "runs": runs}))


if __name__ == "__main__":
    main()
