"""What bounds a CPU here, measured at the start of a run: the CPU flags that pick kernels, the
memory read bandwidth, matmul GFLOP/s, and the default model's weight bytes, so each figure of a
run can be put against the floor of the machine it ran on (machines differ from day to day)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
READ_BYTES = 512 * 2**20  # well past any cache here
MATMUL_SHAPE = (64, 576, 1536)  # rows, in, out: a SmolLM2-135M MLP projection at a decode batch of 64


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return [f for f in FLAGS_OF_INTEREST if f in present]


def _median_s(fn, num_repeats: int) -> float:
    fn()
    times = []
    for _ in range(num_repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth_gb_s(num_repeats: int = 7) -> float:
    import torch

    x = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    return READ_BYTES / _median_s(x.sum, num_repeats) / 1e9


def matmul_gflop_s(dtype_name: str, num_repeats: int = 15) -> float:
    import torch

    rows, k, n = MATMUL_SHAPE
    dtype = getattr(torch, dtype_name)
    x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
    return 2 * rows * k * n / _median_s(lambda: torch.nn.functional.linear(x, w), num_repeats) / 1e9


def model_weight_bytes() -> dict:
    """The default model's parameters at 2 bytes (bfloat16) and 1 byte (int8, scales not counted):
    what one decode step of one stream reads (a tied embedding is the LM head, read once)."""
    import json

    from services.common.model_files import resolve_model

    config = json.loads((resolve_model(None, None).path / "config.json").read_text())
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    num_params = layers * per_layer + config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return {"num_params": num_params, "bfloat16": 2 * num_params, "int8": num_params}


def probe() -> dict:
    out = {"cpu_flags": cpu_flags(), "read_gb_s": read_bandwidth_gb_s(),
           "matmul_shape": list(MATMUL_SHAPE),
           "matmul_gflop_s": {name: matmul_gflop_s(name) for name in ("bfloat16", "float32")}}
    try:
        out["model_weight_bytes"] = model_weight_bytes()
    except (OSError, KeyError, ValueError):
        out["model_weight_bytes"] = None
    return out
