"""Prefix-cache hits on blocks that the same step, or the step still running before it, computes:
the real scheduler with two steps in flight drives the model runner, and every request's greedy
tokens match transformers' float32 ones, as a cold request's would. The runner writes all of a
step's keys and values in a layer before any of them attends, which is what makes such hits safe."""
from __future__ import annotations

import random

from services.common.messages import EngineCoreRequest, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from tests.worker.harness import VOCAB_SIZE, hf_greedy, make_runner

BLOCK_SIZE = 4
MAX_TOKENS = 6


def test_hits_on_blocks_of_the_same_step_and_the_step_in_flight_give_transformers_tokens(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir, block_size=BLOCK_SIZE, num_blocks=128)
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB_SIZE) for _ in range(14)]  # three full blocks and a part
    prompts = [shared + [rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (3, 6, 1, 9)]
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=40), num_blocks=128, block_size=BLOCK_SIZE,
                          max_model_len=256)
    for i, prompt in enumerate(prompts[:3]):
        scheduler.add_request(Request(EngineCoreRequest(
            f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), float(i))))
    in_flight, hits, outputs = [], [], {f"r{i}": [] for i in range(len(prompts))}
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        hits.append({n.req_id: n.num_computed_tokens for n in step.scheduled_new_reqs})
        in_flight.append((step, runner.execute_model(step)))
        if len(hits) == 1:  # the last request arrives while the first step is in flight
            scheduler.add_request(Request(EngineCoreRequest(
                "r3", prompts[3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), 3.0)))
        if len(in_flight) < 2 and step.total_num_scheduled_tokens:
            continue
        done, runner_output = in_flight.pop(0)
        result = scheduler.update_from_output(done, runner_output)
        for req_id, token_ids in zip(result.req_ids, result.new_token_ids):
            outputs[req_id].extend(token_ids)
    # r1 and r2 were admitted beside r0 (their shared blocks computed by that step), r3 in the next.
    assert hits[0] == {"r0": 0, "r1": 12, "r2": 12}
    assert hits[1].get("r3") == 12
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(tiny_llama_dir, prompt, MAX_TOKENS), f"r{i}"
