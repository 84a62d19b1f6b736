"""The decode-attention benchmark measures the kernel it is given and checks it against PyTorch."""
from __future__ import annotations

import torch

from benchmarks.attention_bench import measure
from services.worker.attention.cpu_decode import PagedDecodeKernel
from services.worker.cpu_kernels import load_cpu_kernels


def test_measure_reports_time_bandwidth_and_agreement(kernel_cache):
    library = load_cpu_kernels(kernel_cache)
    assert library is not None, "the CPU kernels must build here (gcc is on every CI machine)"
    kernel = PagedDecodeKernel(library)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        row = measure(kernel, dtype, num_reqs=3, context_len=37, num_heads=4, num_kv_heads=2, head_dim=32,
                      min_time_s=0.01)
        assert row["call_ms"] > 0 and row["kv_gb_per_s"] > 0
        assert row["num_reqs"] == 3 and row["context_len"] == 37
        assert row["max_diff_vs_torch"] < tolerance
