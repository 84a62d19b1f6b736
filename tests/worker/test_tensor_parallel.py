"""Tensor parallelism in the worker: the shard plan, the weight slicing, and two ranks over gloo
giving the tokens and logprobs of one rank (tests/worker/tensor_parallel_harness.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.common.messages import SamplingParams
from services.worker.parallel import CollectiveError, RowParallelLinear, ShardPlan
from services.worker.parallel.weights import shard_tensor
from tests.worker.harness import VOCAB_SIZE, MiniScheduler, hf_greedy, make_runner
from tests.worker.tensor_parallel_harness import TwoRanks


def _config(num_heads: int, num_kv_heads: int, hidden_size: int = 64, intermediate_size: int = 128):
    return SimpleNamespace(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, hidden_size=hidden_size,
                           intermediate_size=intermediate_size)


def _spans(plan: ShardPlan, attr: str) -> list[tuple[int, int]]:
    return [(getattr(r, attr).start, getattr(r, attr).stop) for r in plan.ranks]


def test_smollm2_heads_split_by_whole_kv_groups_unevenly():
    plan = ShardPlan.for_model(_config(9, 3, hidden_size=576, intermediate_size=1536), 2)
    assert _spans(plan, "kv_heads") == [(0, 2), (2, 3)]
    assert _spans(plan, "q_heads") == [(0, 6), (6, 9)]
    assert _spans(plan, "intermediate") == [(0, 768), (768, 1536)]
    assert plan.describe() == "tp=2 q_heads=6+3 kv_heads=2+1 head_dim=64 intermediate=768+768 vocab=replicated"
    local = plan.local_hf_config(_config(9, 3, hidden_size=576, intermediate_size=1536), 1)
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim, local.intermediate_size) == \
        (3, 1, 64, 768)


def test_fewer_kv_heads_than_ranks_replicates_them():
    plan = ShardPlan.for_model(_config(8, 2), 4)
    assert _spans(plan, "kv_heads") == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert _spans(plan, "q_heads") == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert "kv_heads=1+1+1+1 replicated" in plan.describe()


def test_heads_that_cannot_be_split_are_refused():
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        ShardPlan.for_model(_config(4, 2), 3)


def test_checkpoint_tensors_are_cut_to_the_rank():
    plan = ShardPlan.for_model(_config(4, 2, hidden_size=8, intermediate_size=6), 2)  # head_dim 2
    q = torch.arange(8 * 8.0).reshape(8, 8)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.weight", q, plan, 1), q[4:8])
    k = torch.arange(4 * 8.0).reshape(4, 8)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.bias", k[:, 0], plan, 1), k[2:4, 0])
    o = torch.arange(8 * 8.0).reshape(8, 8)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.weight", o, plan, 0), o[:, 0:4])
    down = torch.arange(8 * 6.0).reshape(8, 6)
    assert torch.equal(shard_tensor("model.layers.1.mlp.down_proj.weight", down, plan, 1), down[:, 3:6])
    bias = torch.ones(8)
    assert torch.equal(shard_tensor("model.layers.1.mlp.down_proj.bias", bias, plan, 0), bias)
    assert torch.equal(shard_tensor("model.layers.1.mlp.down_proj.bias", bias, plan, 1), torch.zeros(8))
    embed = torch.ones(10, 8)
    assert shard_tensor("model.embed_tokens.weight", embed, plan, 1) is embed


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    return {f"req-{i}": torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for i, n in enumerate([23, 9, 41, 5])}


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def two_ranks(request):
    model_dir = request.getfixturevalue(request.param)
    ranks = TwoRanks(model_dir)
    yield model_dir, ranks
    ranks.close()


def test_two_ranks_give_transformers_greedy_tokens_and_one_ranks_logprobs(two_ranks):
    """Prompts of several blocks, chunked by a 16-token budget, with logprobs: rank 0 returns the
    tokens of transformers and logprobs within 1e-4 of one rank's; rank 1 runs the same forward and
    appends the same tokens, broadcast by rank 0 (it computes no logits)."""
    model_dir, ranks = two_ranks
    assert sum(isinstance(m, RowParallelLinear) for m in ranks.runners[0].model.modules()) == 4  # 2 layers
    params = SamplingParams(temperature=0.0, logprobs=3)
    single = make_runner(model_dir, block_size=4)
    outputs = {}
    for name, runner in (("tp1", single), ("tp2", ranks)):
        scheduler = MiniScheduler(block_size=4, token_budget=16)
        for req_id, prompt in _prompts().items():
            scheduler.add(req_id, prompt, max_tokens=8, params=params)
        logprobs: dict[str, list] = {req_id: [] for req_id in _prompts()}
        for _ in range(200):
            if scheduler.is_done():
                break
            so = scheduler.schedule()
            out = runner.execute_model(so)
            for req_id, lp in zip(out.req_ids, out.logprobs):
                if lp is not None:
                    logprobs[req_id].append(lp)
            scheduler.update(so, out)
        outputs[name] = ({r: scheduler.outputs(r) for r in _prompts()}, logprobs)
    for req_id, prompt in _prompts().items():
        assert outputs["tp2"][0][req_id] == hf_greedy(model_dir, prompt, 8), req_id
    assert outputs["tp2"][0] == outputs["tp1"][0]
    for req_id in _prompts():
        for ours, theirs in zip(outputs["tp2"][1][req_id], outputs["tp1"][1][req_id], strict=True):
            assert abs(ours.logprob - theirs.logprob) < 1e-4
            assert [t for t, _ in ours.top_logprobs] == [t for t, _ in theirs.top_logprobs]
            assert max(abs(a - b) for (_, a), (_, b) in zip(ours.top_logprobs, theirs.top_logprobs)) < 1e-4
    rank1 = ranks.runners[1]
    assert {r: rank1.requests[r].output_token_ids for r in rank1.requests} == \
        {r: ranks.runners[0].requests[r].output_token_ids for r in ranks.runners[0].requests}
    assert ranks.last_rank1_output.logprobs == [None] * len(ranks.last_rank1_output.req_ids)  # no logits there


def test_a_collective_that_fails_breaks_the_group_until_it_is_formed_again(tiny_llama_dir):
    """Rank 1 leaves the group: rank 0's next collective fails with CollectiveError (not a hang),
    and so does every one after it, at once; a new generation works again."""
    ranks = TwoRanks(tiny_llama_dir, timeout_s=2.0)
    try:
        ranks.groups[1].close()
        ranks.threads[1].submit(lambda: None).result()
        tensor = torch.ones(4)
        with pytest.raises(CollectiveError, match="all-reduce failed"):
            ranks.threads[0].submit(ranks.groups[0].all_reduce, tensor).result(timeout=60)
        with pytest.raises(CollectiveError, match="all-reduce failed"):
            ranks.groups[0].all_reduce(tensor)
        ranks.rendezvous()
        futures = [t.submit(g.all_reduce, torch.ones(4)) for t, g in zip(ranks.threads, ranks.groups)]
        assert [f.result(timeout=60).tolist() for f in futures] == [[2.0] * 4] * 2
    finally:
        ranks.close()
