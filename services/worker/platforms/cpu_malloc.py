"""glibc malloc settings for a CPU worker: a step's activations stay in the heap between steps.

A prefill step allocates and frees tensors of a few MiB to tens of MiB per layer (2,048 tokens of
SmolLM2-135M's [gate | up] in bfloat16: 12 MiB). glibc hands out blocks that large with mmap and
unmaps them when they are freed, or trims the heap top, so every step faulted in and zeroed the
same memory again: in one process, with the harness's c=64 chat workload, a prefill step's median
went 613-636 ms -> 585-614 ms with the settings below, and the slowest of those runs spent 8.1 s
of prefill against 4.8 s (`benchmarks.inprocess_replay --concurrency 64`, docs/benchmarks.md).

The worker's model thread allocates from a glibc arena of its own: heaps of 64 MiB, which honour
the same two settings, but an arena also deletes a heap as soon as it is empty, whatever the trim
threshold, unless the heap before it has less room than the top pad. Served, a c=32 W8A8 slice of
the harness faulted in 310,000 pages (1.2 GiB, 2.7% of the worker's CPU samples in the kernel
zeroing them) in the model thread; with the top pad at a heap's size, 235. Elsewhere (musl, macOS)
there is no `mallopt` and nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (half its 64 MiB heap size); blocks above it
# are still mapped and unmapped, which leaves only the rare huge tensor on the slow path.
MAX_MMAP_THRESHOLD_BYTES = 32 << 20
# Freed memory at the heap top stays until it exceeds this: a worker's activations are a few hundred
# MiB at most, and its weights and KV cache are allocated once.
TRIM_THRESHOLD_BYTES = 1 << 30
# A thread arena's heap size on 64-bit (glibc's HEAP_MAX_SIZE): an empty heap is deleted only if the
# one before it has this much room, which it never has. The main heap grows by this much more each
# time it grows (address space; pages are touched only when used).
TOP_PAD_BYTES = 64 << 20


def keep_step_memory() -> bool:
    """Sets the thresholds and the top pad above; True where glibc took all three."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    try:
        mallopt = libc.mallopt  # glibc's; not every C library has it
    except AttributeError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(mallopt(M_TOP_PAD, TOP_PAD_BYTES))
