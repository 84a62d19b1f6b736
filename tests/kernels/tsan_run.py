"""Runs small kernel cases in the shim's threads mode; the slow test runs this file in a Python
whose libtsan is preloaded, so ThreadSanitizer watches every CUDA thread's memory accesses.

usage: python -m tests.kernels.tsan_run LIBRARY [attention|prefill|sampling|cache ...]
Exits 1 if a result is wrong; ThreadSanitizer's own reports go to stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from services.worker.kernels.cache_ops import reshape_and_cache
from tests.kernels.cuda_shim.build import ShimLauncher
from tests.kernels.paged_batch import make_batch, reference_attention


def check_attention(shim) -> bool:
    from tests.kernels.test_attention_kernels import run_attention

    ok = True
    for heads, partitions in (((6, 2), 1), ((8, 1), 2)):
        batch = make_batch(*heads, 64, torch.float32, seed=1, requests=((0, 3), (1, 1), (130, 1)))
        error = float((run_attention(shim, batch, partitions) - reference_attention(batch, 0.125)).abs().max())
        print(f"attention {heads} partitions={partitions}: max error {error:.2e}")
        ok &= error < 2e-5
    return ok


def check_prefill(shim) -> bool:
    from tests.kernels.test_prefill_attention_kernels import run_prefill

    batch = make_batch(6, 2, 64, torch.float16, block_size=32, seed=2, requests=((0, 20), (45, 21)))
    error = float((run_prefill(shim, batch).double() - reference_attention(batch, 0.125)).abs().max())
    print(f"prefill: max error {error:.2e}")
    return error < 1.5e-3


def check_sampling(shim) -> bool:
    from tests.kernels.test_sampling_kernels import draw

    logits = torch.randn(3, 300)
    greedy = draw(shim, logits, temperature=0.0)
    sampled = draw(shim, logits, temperature=1.0, top_k=5, top_p=0.9)
    print(f"sampling: greedy {greedy.tolist()}, sampled {sampled.tolist()}")
    top5 = logits.topk(5).indices
    return greedy.tolist() == logits.argmax(-1).tolist() and all(s in t for s, t in zip(sampled, top5))


def check_cache(shim) -> bool:
    batch = make_batch(2, 2, 64, torch.bfloat16, requests=((0, 4), (3, 1)))
    cache = batch.kv_cache.clone()
    shim(reshape_and_cache(cache, batch.key, batch.value, batch.common.slot_mapping))
    ok = torch.equal(cache[0].view(-1, 2, 64)[batch.common.slot_mapping], batch.key)
    print(f"cache: {'ok' if ok else 'WRONG'}")
    return ok


CHECKS = {"attention": check_attention, "prefill": check_prefill, "sampling": check_sampling, "cache": check_cache}


def main(argv: list[str]) -> int:
    shim = ShimLauncher(Path(argv[0]), mode="threads")
    results = [CHECKS[name](shim) for name in argv[1:] or CHECKS]
    return 0 if all(results) else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
