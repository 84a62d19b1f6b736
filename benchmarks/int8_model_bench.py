"""`--quantization int8` against bf16 on the embedded SmolLM2-135M: decode speed and output drift.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.int8_model_bench [--threads 2]
        [--batch-sizes 1,8,32] [--models none,int8,...] [--max-tokens 64] [--out benchmarks/results/int8_model.json]

Speed: decode steps of the worker (benchmarks.step_bench.run_batch, the real scheduler, 128-token
prompts), each batch size run three times per model, the models alternating; the median of the
three runs' median steps. The models: bf16 (`none`, its matmuls of up to 8 rows on the bf16
GEMV), int8 (`int8`, up to 8 rows on the int8 GEMV) and int8 with `--cpu-gemv false`
(`int8-no-gemv`: int8pack_mm or the widening GEMM, the int8 path before the GEMV). Drift: the 8 parity prompts of
tests/e2e/test_default_model.py in the chat template, greedy for `--max-tokens` tokens with EOS
ignored, bf16 and int8 each alone: how many keep identical tokens, where the first divergence is,
and the largest |logprob difference| of the chosen token over each prompt's common prefix (up to
and including the first divergent position). bf16 against float32 is given beside it as the yardstick.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.int8_linear_bench import CPU_FLAGS
from benchmarks.step_bench import run_batch
from services.common.messages import EngineCoreRequest, SamplingParams
from services.common.model_files import resolve_model
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.worker import Worker
from tests.e2e.test_default_model import PROMPTS


SPEED_MODELS = {"none": ("none", True), "int8": ("int8", True), "int8-no-gemv": ("int8", False),
                "w8a8": ("w8a8", True), "w8a8-no-gemv": ("w8a8", False)}
# The drift of each against bf16. A prompt alone decodes one row a step, which w8a8 keeps on the
# weight-only GEMV (only its prefill quantizes activations); w8a8-no-gemv quantizes every matmul's,
# as a batch of more than 16 rows does.
DRIFT_MODELS = ("int8", "w8a8", "w8a8-no-gemv")


def make_worker(quantization: str, dtype: str = "bfloat16", cpu_gemv: bool = True) -> Worker:
    worker = Worker(WorkerConfig(dtype=dtype, quantization=quantization, kv_cache_bytes=256 * 2**20,
                                 max_model_len=2048, cpu_gemv=cpu_gemv))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return worker


def greedy(worker: Worker, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    spec = worker.describe_kv_cache()
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=2048), spec.num_blocks, spec.block_size,
                          spec.max_model_len)
    worker.model_runner.reset()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    scheduler.add_request(Request(EngineCoreRequest("p", prompt, params, 0.0)))
    tokens, logprobs = [], []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        out = worker.execute_model(so)
        for token_ids, lp in zip(out.sampled_token_ids, out.logprobs):
            tokens += token_ids
            if token_ids and lp is not None:
                logprobs.append(lp.logprob)
        scheduler.update_from_output(so, out)
    return tokens, logprobs


def drift(reference: list[tuple[list[int], list[float]]], other: list[tuple[list[int], list[float]]]) -> dict:
    rows = []
    for (ref_tokens, ref_lps), (tokens, lps) in zip(reference, other):
        common = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), len(ref_tokens))
        # Up to and including the first divergent position: both saw the same context there.
        span = min(common + 1, len(ref_lps), len(lps))
        rows.append({"identical": ref_tokens == tokens, "first_divergence": None if ref_tokens == tokens else common,
                     "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(ref_lps[:span], lps[:span]))})
    return {"num_identical": sum(r["identical"] for r in rows), "num_prompts": len(rows), "prompts": rows}


def cpu_flags(threads: int) -> list[str]:
    """This CPU's flags of interest, printed with the thread count and torch's version."""
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f in CPU_FLAGS})
    print(f"CPU flags: {' '.join(flags)}; {threads} threads; torch {torch.__version__}")
    return flags


def parity_chat_prompts() -> list[list[int]]:
    """The 8 parity prompts of tests/e2e/test_default_model.py in the embedded model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None).path))
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--models", default=",".join(SPEED_MODELS), help="of " + ",".join(SPEED_MODELS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/int8_model.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = cpu_flags(args.threads)
    prompts = parity_chat_prompts()
    results: dict = {"threads": args.threads, "cpu_flags": flags, "speed": {}, "outputs": {}}
    names = ["none", *(n for n in args.models.split(",") if n != "none")]
    workers = {name: make_worker(SPEED_MODELS[name][0], cpu_gemv=SPEED_MODELS[name][1]) for name in names}
    for name in ("none", *(n for n in DRIFT_MODELS if n in workers)):
        results["outputs"][name] = [greedy(workers[name], p, args.max_tokens) for p in prompts]
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        # The models' runs alternate, so a slow minute of this shared VM hits all alike.
        runs = {name: [] for name in workers}
        for _ in range(3):
            for name, worker in workers.items():
                runs[name].append(run_batch(worker, bs, 128, args.decode_steps))
        for name, rows in runs.items():
            row = {k: statistics.median(r[k] for r in rows) for k in ("decode_step_ms", "decode_tok_s")}
            row["runs_tok_s"] = [r["decode_tok_s"] for r in rows]
            results["speed"][f"{name}/{bs}"] = row
            print(f"{name:12s} batch {bs:3d}: decode step {row['decode_step_ms']:7.2f} ms = "
                  f"{row['decode_tok_s']:7.1f} tok/s (runs {', '.join(f'{t:.1f}' for t in row['runs_tok_s'])})",
                  flush=True)
    del workers
    float32 = make_worker("none", "float32")
    results["outputs"]["float32"] = [greedy(float32, p, args.max_tokens) for p in prompts]
    del float32
    results["drift"] = {f"{name}_vs_bf16": drift(results["outputs"]["none"], results["outputs"][name])
                        for name in DRIFT_MODELS if name in results["outputs"]}
    results["drift"]["bf16_vs_float32"] = drift(results["outputs"]["float32"], results["outputs"]["none"])
    for name, d in results["drift"].items():
        print(f"{name}: identical greedy {d['num_identical']}/{d['num_prompts']} over {args.max_tokens} tokens; "
              f"first divergences {[r['first_divergence'] for r in d['prompts']]}; max |dlogprob| over the "
              f"common prefix {max(r['max_abs_logprob_diff'] for r in d['prompts']):.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
