"""The fake-model runner the engine-overhead benchmark uses: the real Scheduler's diffs, no model."""
from __future__ import annotations

import torch

from services.common.messages import EngineCoreRequest, FinishReason, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.fake_runner import FAKE_TOKEN_ID, FakeModelRunner, load_fake_model
from services.worker.kv_cache import KVCacheLayout
from tests.step_outputs import per_request


def test_chunked_prefill_samples_only_at_the_end_then_one_token_per_step():
    runner = FakeModelRunner(KVCacheLayout(2, 1, 8, 16, torch.float32))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32), num_blocks=64, block_size=16, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    scheduler.add_request(Request(EngineCoreRequest("long", list(range(100, 170)), params, 0.0)))  # 70 tokens
    scheduler.add_request(Request(EngineCoreRequest("short", [5, 6, 7], params, 0.0)))
    tokens: dict[str, list[int]] = {"long": [], "short": []}
    finished = {}
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        ro = runner.execute_model(so)
        for req_id, sampled in zip(ro.req_ids, ro.sampled_token_ids):
            tokens[req_id] += sampled
        for out in per_request(scheduler.update_from_output(so, ro)):
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert tokens == {"long": [FAKE_TOKEN_ID] * 3, "short": [FAKE_TOKEN_ID] * 3}
    assert finished == {"long": FinishReason.LENGTH, "short": FinishReason.LENGTH}


def test_spec_reports_blocks_for_the_budget_without_allocating():
    runner, spec = load_fake_model(WorkerConfig(fake_model=True, kv_cache_bytes=64 * 2**30, max_num_seqs=1024),
                                   torch.float32)
    assert spec.vocab_size == 49152 and spec.max_model_len == 8192
    assert spec.num_blocks == 64 * 2**30 // spec.block_bytes
    assert runner.initialize_kv_cache(spec.num_blocks) == spec.num_blocks * spec.block_bytes
