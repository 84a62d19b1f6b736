"""Small factories for scheduler tests: no model, no gRPC."""
from __future__ import annotations

import itertools

from services.common.messages import EngineCoreRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from tests.step_outputs import per_request

EOS = 2
_ids = itertools.count()


def make_scheduler(num_blocks: int = 1000, block_size: int = 16, max_model_len: int = 4096, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), num_blocks=num_blocks, block_size=block_size,
                     max_model_len=max_model_len)


def make_requests(num_requests: int, prompt_len: int = 10, max_tokens: int = 8, priority: int = 0,
                  prefix: list[int] | None = None, **params) -> list[Request]:
    requests = []
    for _ in range(num_requests):
        n = next(_ids)
        prompt = (prefix or []) + [100 + (n * 7 + i) % 1000 for i in range(prompt_len)]
        req = EngineCoreRequest(
            request_id=f"req-{n}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
            arrival_time=float(n),
            priority=priority,
            eos_token_ids=(EOS,),
        )
        requests.append(Request(req))
    return requests


def fake_runner_output(scheduler: Scheduler, output: SchedulerOutput, token_id: int = 7) -> ModelRunnerOutput:
    """What a worker would return: one token for each request whose scheduled tokens reach its end."""
    req_ids, sampled = [], []
    for req_id, n in output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        req_ids.append(req_id)
        # num_computed_tokens was advanced by schedule(); equal to num_tokens means a full catch-up.
        sampled.append([token_id] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        output = scheduler.schedule()
        outputs.extend(per_request(scheduler.update_from_output(output, fake_runner_output(scheduler, output))))
    raise AssertionError("requests did not finish")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not scheduler.kv_cache_manager.req_to_blocks


__all__ = ["RequestStatus", "make_requests", "make_scheduler", "run_to_completion", "fake_runner_output",
           "assert_all_blocks_free", "EOS"]
