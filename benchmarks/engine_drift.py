"""How far each engine's reduced precision moves greedy output from float32: Spindle's rows and
OpenVINO GenAI's, on the same prompts, so that the throughput comparison is between rows of like
accuracy.

    flock /tmp/spindle-cpu.lock .venv/bin/python -m benchmarks.engine_drift [--max-tokens 64]
        [--configs float32-kv8,bf16,bf16-kv8,w8a8,w8a8-kv8] [--no-openvino]
        [--out benchmarks/results/engine_drift.json]

`--configs` takes any of `SPINDLE_CONFIGS` (int8, int8-kv8, w8a8-rows, w8a8-rows-kv8 and w8a8-g64 too).

The 8 parity prompts of tests/e2e/test_default_model.py and 24 more (`MORE_PROMPTS`: eight prompts
are too few, as a near-tie at the first token ends a row's agreement by chance), in the chat
template, each alone, greedy for `--max-tokens` tokens with EOS ignored. The reference is Spindle
in float32, which the parity tests hold to Hugging Face transformers token for token. Per row: how
many prompts keep every token, and the tokens kept before the first divergence (their mean, and
the list). Each int8 row is also
set against its own engine's bf16 row. OpenVINO runs in its venv (`benchmarks.openvino_greedy`,
`python -m benchmarks.peers install openvino` first), with the pipeline the benchmark drives.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks import peers
from benchmarks.int8_model_bench import cpu_flags, greedy, parity_chat_prompts
from services.common.model_files import resolve_model
from benchmarks.server_catalog import model_folder
from services.worker.config import WorkerConfig
from services.worker.worker import Worker

ROOT = Path(__file__).resolve().parents[1]
# name -> (dtype, quantization, kv_cache_dtype, w8a8_group_size); W8A8's groups: the worker's
# default (32 on the int8 tiles) unless the name says otherwise (-rows: one scale per row).
SPINDLE_CONFIGS = {
    "float32": ("float32", "none", "auto", -1),
    "float32-kv8": ("float32", "none", "int8", -1),
    "bf16": ("bfloat16", "none", "auto", -1),
    "bf16-kv8": ("bfloat16", "none", "int8", -1),
    "int8": ("bfloat16", "int8", "auto", -1),
    "int8-kv8": ("bfloat16", "int8", "int8", -1),
    "w8a8": ("bfloat16", "w8a8", "auto", -1),
    "w8a8-kv8": ("bfloat16", "w8a8", "int8", -1),
    "w8a8-rows": ("bfloat16", "w8a8", "auto", 0),
    "w8a8-rows-kv8": ("bfloat16", "w8a8", "int8", 0),
    "w8a8-g64": ("bfloat16", "w8a8", "auto", 64),
}
MORE_PROMPTS = (
    "Summarize the history of the printing press in two sentences.",
    "How do I reverse a list in Python?",
    "Describe the water cycle for a ten-year-old.",
    "What are three good habits for staying healthy in winter?",
    "Write a short story about a robot that learns to paint.",
    "Compare trains and planes for travelling across Europe.",
    "Why is the sky blue?",
    "Suggest a name for a bakery that sells only bread.",
    "What does a compiler do?",
    "Give two arguments for and against working from home.",
    "Explain what a prime number is to a child.",
    "Write a polite email declining a meeting invitation.",
    "What is photosynthesis?",
    "List the planets of the solar system in order.",
    "How can I make my tomato plants grow better?",
    "What is the difference between weather and climate?",
    "Write a limerick about a cat who loves cheese.",
    "Explain recursion with a simple example.",
    "What should I pack for a weekend hiking trip?",
    "Who was Marie Curie?",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.",
    "What are the main causes of inflation?",
    "Describe a sunset over the ocean in three sentences.",
    "How does a bicycle stay upright when it moves?",
)
# Each row's same-engine bf16 row, against which it is also compared: every other bfloat16 row's.
BF16_OF = {**{name: "bf16" for name, (dtype, *_) in SPINDLE_CONFIGS.items() if dtype == "bfloat16" and name != "bf16"},
           "openvino-int8": "openvino-bf16"}


def chat_prompts(texts) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None).path))
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def spindle_outputs(name: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    dtype, quantization, kv_cache_dtype, group_size = SPINDLE_CONFIGS[name]
    worker = Worker(WorkerConfig(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                 w8a8_group_size=group_size, kv_cache_bytes=256 * 2**20, max_model_len=2048))
    worker.load_model()
    worker.initialize_kv_cache(0)
    return [greedy(worker, p, max_tokens)[0] for p in prompts]


def openvino_outputs(variant: str, prompts: list[list[int]], max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        prompts_path, out_path = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        prompts_path.write_text(json.dumps(prompts))
        command = [str(peers.venv_python("openvino")), "-m", "benchmarks.openvino_greedy", "--model-dir",
                   model_folder(), "--variant", variant, "--ir-root", str(peers.venv_dir("openvino") / "ir"),
                   "--prompts", str(prompts_path), "--max-tokens", str(max_tokens), "--out", str(out_path)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"openvino {variant}: {done.stderr.strip()[-500:]}")
        return json.loads(out_path.read_text())


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Per prompt, the tokens `other` keeps before it first differs from `reference`."""
    kept = [next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            for ref, out in zip(reference, other)]
    return {"num_identical": sum(ref == out for ref, out in zip(reference, other)), "num_prompts": len(kept),
            "mean_tokens_kept": statistics.fmean(kept), "tokens_kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", default="float32-kv8,bf16,bf16-kv8,w8a8,w8a8-kv8",
                        help="of " + ",".join(SPINDLE_CONFIGS))
    parser.add_argument("--openvino", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default="benchmarks/results/engine_drift.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = parity_chat_prompts() + chat_prompts(MORE_PROMPTS)
    results: dict = {"cpu_flags": cpu_flags(args.threads), "max_tokens": args.max_tokens, "info": {},
                     "outputs": {}, "vs_float32": {}, "vs_own_bf16": {}}
    for name in ["float32", *(c for c in args.configs.split(",") if c != "float32")]:
        results["outputs"][name] = spindle_outputs(name, prompts, args.max_tokens)
    if args.openvino:
        for variant in ("bf16", "int8"):
            raw = openvino_outputs(variant, prompts, args.max_tokens)
            results["outputs"][f"openvino-{variant}"] = raw.pop("outputs")
            results["info"][f"openvino-{variant}"] = raw
    outputs = results["outputs"]
    for name, rows in outputs.items():
        if name == "float32":
            continue
        results["vs_float32"][name] = agreement(outputs["float32"], rows)
        if BF16_OF.get(name) in outputs:
            results["vs_own_bf16"][name] = agreement(outputs[BF16_OF[name]], rows)
    print(f"{'row':14s} vs float32: identical, tokens kept (mean, median)    vs its bf16 row")
    for name, row in results["vs_float32"].items():
        own = results["vs_own_bf16"].get(name)
        own_text = f"{own['num_identical']}/{own['num_prompts']}, {own['mean_tokens_kept']:.1f}" if own else "-"
        print(f"{name:14s} {row['num_identical']:2d}/{row['num_prompts']}, {row['mean_tokens_kept']:5.1f}, "
              f"{statistics.median(row['tokens_kept']):5.1f}{'':24s}{own_text}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
