"""CUDA C kernels for the GPU path, shipped as package data and compiled by NVRTC on first use.

- `common.cuh`: 16-bit float storage and conversions, vector loads, reductions, Philox;
- `cache.cu` / `cache_ops.py`: reshape_and_cache;
- `attention.cu` / `attention_ops.py`: paged attention (mixed batch, GQA, split-K + combine);
- `prefill_attention.cu` / `prefill_attention_ops.py`: tiled prefill attention on tensor cores
  (bf16/fp16, the prefill rows of a step);
- `wmma.cuh`: nvcuda::wmma for NVRTC on the compiler's intrinsics (no toolkit header);
- `sampling.cu` / `sampling_ops.py`: sparse logits processors and the per-row sampler;
- `bitmask.cu` / `bitmask_ops.py`: a grammar's allowed-token bitmask applied to the logits;
- `loader.py`: the module list, template instances and the cached CuPy loader / launcher;
- `launch.py`: the launch description shared by CuPy and the CPU test shim;
- `nvrtc.py`: compile check and resource report without a GPU.
Importing any of these compiles nothing and does not import CuPy.
"""
