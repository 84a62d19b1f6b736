"""ModelRunner driven directly with SchedulerOutput dataclasses: greedy parity with transformers."""
from __future__ import annotations

import pytest
import torch

from services.common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from services.worker.platforms import cpu as cpu_platform
from tests.worker.harness import VOCAB_SIZE, MiniScheduler, hf_greedy, make_runner
from tests.worker.cpu_features import needs_bf16_packing

GREEDY = SamplingParams(temperature=0.0)


def _prompts(lengths: list[int], seed: int = 1) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"req-{i}": torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for i, n in enumerate(lengths)}


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_batched_greedy_matches_transformers(model_fixture, request):
    """Several requests of different lengths in one batch, prompts spanning many 4-token blocks;
    a 32-token budget splits the longer prompts into chunks over several steps, so steps mix
    prefill chunks with decodes."""
    model_dir = request.getfixturevalue(model_fixture)
    runner = make_runner(model_dir, block_size=4)
    prompts = _prompts([23, 9, 41, 1, 16])
    scheduler = MiniScheduler(block_size=4, token_budget=32)
    for req_id, prompt in prompts.items():
        scheduler.add(req_id, prompt, max_tokens=10)
    scheduler.run(runner)
    for req_id, prompt in prompts.items():
        assert scheduler.outputs(req_id) == hf_greedy(model_dir, prompt, 10), req_id


def _bf16_greedy_tokens(model_dir, prompts: dict[str, list[int]], **runner_kwargs) -> dict[str, list[int]]:
    runner = make_runner(model_dir, block_size=4, dtype=torch.bfloat16, **runner_kwargs)
    scheduler = MiniScheduler(block_size=4, token_budget=32)
    for req_id, prompt in prompts.items():
        scheduler.add(req_id, prompt, max_tokens=8)
    scheduler.run(runner)
    return {req_id: scheduler.outputs(req_id) for req_id in prompts}


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bf16_float32_weight_copy_gives_the_same_greedy_tokens(model_fixture, request, monkeypatch):
    """bfloat16 weights on a CPU without native bfloat16: batches of more than 2 rows multiply on
    the float32 copy or on weights widened per call; both round one float32 product, so the
    tokens agree."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
    model_dir = request.getfixturevalue(model_fixture)
    prompts = _prompts([23, 9, 41, 16], seed=4)
    with_copy = _bf16_greedy_tokens(model_dir, prompts, float32_copy=True)
    widened = _bf16_greedy_tokens(model_dir, prompts, float32_copy=False)
    assert with_copy == widened
    assert all(len(t) == 8 for t in with_copy.values())


@needs_bf16_packing
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bf16_weights_prepacked_natively_give_the_same_greedy_tokens(model_fixture, request, monkeypatch):
    """On a CPU with native bfloat16 the weights are prepacked as they are and multiplied in
    bfloat16 with float32 sums, as the float32-copy path rounds its float32 products."""
    model_dir = request.getfixturevalue(model_fixture)
    prompts = _prompts([23, 9, 41, 16], seed=4)
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
    with_copy = _bf16_greedy_tokens(model_dir, prompts, float32_copy=True)
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
    runner = make_runner(model_dir, block_size=4, dtype=torch.bfloat16, float32_copy=True)
    packed = [m for m in runner.model.modules() if getattr(m, "weight_is_packed", False)]
    assert packed and all(m.packed_weight.dtype == torch.bfloat16 for m in packed)
    assert _bf16_greedy_tokens(model_dir, prompts, float32_copy=True) == with_copy


def test_prompt_prefilled_in_two_chunks(tiny_llama_dir):
    """Hand-built steps: a 14-token prompt as 8 + 6 tokens; the partial chunk samples nothing."""
    prompt = _prompts([14])["req-0"]
    expected = hf_greedy(tiny_llama_dir, prompt, 3)
    runner = make_runner(tiny_llama_dir, block_size=4)

    step0 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", prompt, GREEDY, block_ids=[5, 9], num_computed_tokens=0)],
        num_scheduled_tokens={"a": 8}, total_num_scheduled_tokens=8, step_id=0,
    )
    out0 = runner.execute_model(step0)
    assert out0.req_ids == ["a"] and out0.sampled_token_ids == [[]] and out0.step_id == 0

    def cached_step(step_id: int, new_blocks: list[int], num_computed: int, n: int) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(["a"], [False], [new_blocks], [num_computed], [[]]),
            num_scheduled_tokens={"a": n}, total_num_scheduled_tokens=n, step_id=step_id,
        )

    out1 = runner.execute_model(cached_step(1, [2, 7], 8, 6))  # tokens 8..13; blocks for 16 slots
    assert out1.sampled_token_ids == [[expected[0]]]
    out2 = runner.execute_model(cached_step(2, [], 14, 1))
    out3 = runner.execute_model(cached_step(3, [], 15, 1))
    assert [out2.sampled_token_ids[0][0], out3.sampled_token_ids[0][0]] == expected[1:]
    assert out3.forward_ns > 0 and out3.prepare_ns > 0


def test_finished_and_preempted_requests(tiny_llama_dir):
    """A finished request leaves; a preempted one resumes with a new block table and recomputes."""
    prompts = _prompts([10, 6])
    expected = {r: hf_greedy(tiny_llama_dir, p, 4) for r, p in prompts.items()}
    runner = make_runner(tiny_llama_dir, block_size=4)
    a, b = prompts["req-0"], prompts["req-1"]
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", a, GREEDY, [1, 2, 3], 0), NewRequestData("b", b, GREEDY, [4, 5], 0)],
        num_scheduled_tokens={"a": 10, "b": 6}, total_num_scheduled_tokens=16,
    ))
    assert out.req_ids == ["a", "b"]
    a_tokens, b_tokens = a + out.sampled_token_ids[0], b + out.sampled_token_ids[1]
    # b is preempted; a decodes alone.
    out = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [10], [[]]),
        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, preempted_req_ids={"b"},
    ))
    a_tokens += out.sampled_token_ids[0]
    assert "b" not in runner.input_batch.req_id_to_index
    # b resumes in other blocks and recomputes prompt + its sampled token; a finishes.
    out = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["b"], [True], [[8, 9]], [0], [b_tokens]),
        num_scheduled_tokens={"b": len(b_tokens)}, total_num_scheduled_tokens=len(b_tokens), finished_req_ids={"a"},
    ))
    b_tokens += out.sampled_token_ids[0]
    assert "a" not in runner.requests and runner.input_batch.num_reqs == 1
    assert a_tokens[len(a):] == expected["req-0"][:2]
    assert b_tokens[len(b):] == expected["req-1"][:2]


def test_unknown_request_raises_and_empty_step(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    assert runner.execute_model(SchedulerOutput(step_id=7)).req_ids == []
    with pytest.raises(ValueError, match="does not hold"):
        runner.execute_model(SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(["ghost"], [False], [[]], [3], [[]]),
            num_scheduled_tokens={"ghost": 1}, total_num_scheduled_tokens=1,
        ))


def test_cached_requests_take_the_schedulers_count_every_step(tiny_llama_dir):
    """The count comes from the scheduler, not from what the runner computed: here it recomputes the
    last prompt token with the sampled one (5 + 2 tokens; the runner's own 6 + 2 would exceed 7)."""
    prompt = _prompts([6])["req-0"]
    expected = hf_greedy(tiny_llama_dir, prompt, 2)
    runner = make_runner(tiny_llama_dir, block_size=4)
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", prompt, GREEDY, [1, 2], 0)],
        num_scheduled_tokens={"a": 6}, total_num_scheduled_tokens=6, step_id=1))
    assert out.sampled_token_ids == [[expected[0]]]
    out = runner.execute_model(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [5], [[]]),
        num_scheduled_tokens={"a": 2}, total_num_scheduled_tokens=2, step_id=2))
    assert out.sampled_token_ids == [[expected[1]]]
    # Without its count a cached request is refused: the runner keeps no count of its own to fall back on.
    with pytest.raises(ValueError, match="shorter"):
        runner.execute_model(SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(["a"], [False], [[]], [], [[]]),
            num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, step_id=3))


def test_scheduling_more_tokens_than_known_fails_the_request(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [5, 6, 7], GREEDY, [1], 0)],
        num_scheduled_tokens={"a": 4}, total_num_scheduled_tokens=4,
    ))
    assert out.req_ids == [] and "exceed" in out.failed_reqs["a"]  # that request alone fails


def test_initialize_kv_cache_drops_requests(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [5, 6, 7], GREEDY, [1], 0)],
        num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3,
    ))
    assert runner.input_batch.num_reqs == 1
    runner.initialize_kv_cache(16)
    assert runner.input_batch.num_reqs == 0 and not runner.requests
    assert runner.kv_caches[0].shape[1] == 16


def test_seeded_sampling_independent_of_batch(tiny_llama_dir):
    """The same seed gives the same tokens alone and batched with other (random) requests."""
    prompts = _prompts([12, 7, 20])
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def run(batch: dict[str, list[int]]) -> list[int]:
        scheduler = MiniScheduler(block_size=4, token_budget=64)
        for req_id, prompt in batch.items():
            params = seeded if req_id == "req-0" else SamplingParams(temperature=1.0)
            scheduler.add(req_id, prompt, max_tokens=8, params=params)
        scheduler.run(make_runner(tiny_llama_dir))
        return scheduler.outputs("req-0")

    alone = run({"req-0": prompts["req-0"]})
    together = run({"req-2": prompts["req-2"], "req-1": prompts["req-1"], "req-0": prompts["req-0"]})
    assert alone == together


def test_a_requests_knobs_and_history_follow_it_when_its_row_moves(tiny_llama_dir):
    """A seeded request with penalties, top-k, logit bias and min_tokens draws the same tokens
    alone and third in a batch whose first two requests finish early, so that condense moves its
    row to 0. The bias makes EOS (2) near certain, so the tokens show min_tokens banning it exactly
    until the fourth output."""
    prompts = _prompts([9, 13, 11])
    knobs = SamplingParams(temperature=1.0, top_k=20, seed=77, presence_penalty=0.3, frequency_penalty=0.2,
                           repetition_penalty=1.1, logit_bias={2: 30.0}, min_tokens=4)

    def run(batch: dict[str, list[int]]) -> list[int]:
        scheduler = MiniScheduler(block_size=4, token_budget=64)
        for req_id, prompt in batch.items():
            params = knobs if req_id == "req-2" else SamplingParams(temperature=0.8, top_p=0.9, seed=1)
            scheduler.add(req_id, prompt, max_tokens=8 if req_id == "req-2" else 2, params=params)
        runner = make_runner(tiny_llama_dir)
        so = scheduler.schedule()
        scheduler.update(so, runner.execute_model(so))
        assert runner.input_batch.req_id_to_index["req-2"] == len(batch) - 1
        scheduler.run(runner)
        assert runner.input_batch.req_id_to_index == {"req-2": 0}
        return scheduler.outputs("req-2")

    alone = run({"req-2": prompts["req-2"]})
    assert run(prompts) == alone
    assert 2 not in alone[:4] and alone[4] == 2
