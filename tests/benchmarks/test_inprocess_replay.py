"""benchmarks.inprocess_replay: the closed loop replaces finished requests and counts every token."""
from __future__ import annotations

from benchmarks.inprocess_replay import replay
from services.worker.config import WorkerConfig
from services.worker.worker import Worker


def test_closed_loop_runs_every_request_to_its_length():
    worker = Worker(WorkerConfig(fake_model=True, kv_cache_bytes=2**30, max_model_len=256))
    worker.load_model()
    worker.initialize_kv_cache(0)
    prompts = [([1, 2, 3, 4, 5], 4), ([6, 7, 8], 2), ([9, 10, 11, 12], 3)]
    summary = replay(worker, prompts, concurrency=2)
    assert summary["num_output_tokens"] == 4 + 2 + 3
    # every prompt token once (no cache hits) and one decode token per output token after the first
    assert summary["prefill"]["num_tokens"] + summary["decode"]["num_tokens"] == 12 + (3 + 1 + 2)
    assert summary["prefill"]["num_steps"] == 2  # the first two together, the third when one finished
    assert summary["decode"]["mean_num_reqs"] <= 2  # never more than the concurrency
