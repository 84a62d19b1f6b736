"""Tensor parallelism in the worker: the shard plan, the weight slicing, and two ranks over gloo
giving the logits, tokens and logprobs of one rank, the LM head split by vocabulary
(tests/worker/tensor_parallel_harness.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.common.messages import SamplingParams
from services.worker.model_loader import load_config
from services.worker.parallel import CollectiveError, RowParallelLinear, ShardPlan, VocabParallelLMHead
from services.worker.parallel.weights import shard_tensor
from tests.worker.harness import MiniScheduler, hf_greedy, make_runner
from tests.worker.tensor_parallel_harness import TwoRanks, save_tiny_tied_model

ODD_VOCAB_SIZE = 509


def _config(num_heads: int, num_kv_heads: int, hidden_size: int = 64, intermediate_size: int = 128,
            vocab_size: int = 512):
    return SimpleNamespace(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, vocab_size=vocab_size)


def _spans(plan: ShardPlan, attr: str) -> list[tuple[int, int]]:
    return [(getattr(r, attr).start, getattr(r, attr).stop) for r in plan.ranks]


def test_smollm2_heads_split_by_whole_kv_groups_unevenly():
    plan = ShardPlan.for_model(_config(9, 3, hidden_size=576, intermediate_size=1536, vocab_size=49152), 2)
    assert _spans(plan, "kv_heads") == [(0, 2), (2, 3)]
    assert _spans(plan, "q_heads") == [(0, 6), (6, 9)]
    assert _spans(plan, "intermediate") == [(0, 768), (768, 1536)]
    assert _spans(plan, "vocab") == [(0, 24576), (24576, 49152)]
    assert plan.describe() == ("tp=2 q_heads=6+3 kv_heads=2+1 head_dim=64 intermediate=768+768 "
                               "lm_head_vocab=24576+24576 embedding=replicated")
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


def test_a_vocabulary_that_does_not_divide_is_split_unevenly_and_named_in_the_layout():
    plan = ShardPlan.for_model(_config(4, 2, vocab_size=ODD_VOCAB_SIZE), 2)
    assert _spans(plan, "vocab") == [(0, 255), (255, 509)]
    assert "lm_head_vocab=255+254 " in plan.describe()
    assert _spans(ShardPlan.for_model(_config(4, 4, vocab_size=10), 4), "vocab") == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ShardPlan.for_model(_config(4, 2, vocab_size=510), 2).describe() != plan.describe()
    with pytest.raises(ValueError, match="vocabulary 1 is smaller than 2 ranks"):
        ShardPlan.for_model(_config(4, 2, vocab_size=1), 2)


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
    embed = torch.arange(512 * 8.0).reshape(512, 8)
    assert shard_tensor("model.embed_tokens.weight", embed, plan, 1) is embed
    assert torch.equal(shard_tensor("lm_head.weight", embed, plan, 0), embed[0:256])
    assert torch.equal(shard_tensor("lm_head.weight", embed, plan, 1), embed[256:512])


def _prompts(vocab_size: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    return {f"req-{i}": torch.randint(3, vocab_size, (n,), generator=g).tolist() for i, n in enumerate([23, 9, 41, 5])}


@pytest.fixture(scope="module")
def tiny_tied_odd_vocab_dir(tmp_path_factory):
    return save_tiny_tied_model(tmp_path_factory.mktemp("tiny-tied-odd-vocab"), ODD_VOCAB_SIZE)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_tied_odd_vocab_dir"])
def two_ranks(request):
    model_dir = request.getfixturevalue(request.param)
    ranks = TwoRanks(model_dir)
    yield model_dir, ranks
    ranks.close()


def _record_logits(runner) -> list:
    """What `runner.model.compute_logits` returns at every step from now on."""
    recorded, compute_logits = [], runner.model.compute_logits

    def recording(hidden_states):
        logits = compute_logits(hidden_states)
        recorded.append(logits)
        return logits

    runner.model.compute_logits = recording
    return recorded


def test_two_ranks_give_one_ranks_logits_transformers_greedy_tokens_and_one_ranks_logprobs(two_ranks):
    """Prompts of several blocks, chunked by a 16-token budget, with logprobs: every step's logits
    on rank 0, gathered from both ranks' vocabulary slices, are within 1e-4 of one rank's; rank 0
    returns the tokens of transformers and logprobs within 1e-4 of one rank's; rank 1 computes its
    slice only (its compute_logits gives None) and appends the same tokens, broadcast by rank 0.
    The tied model with an odd vocabulary splits it 255 + 254, its slices views of the embedding."""
    model_dir, ranks = two_ranks
    vocab_size = load_config(model_dir).vocab_size
    prompts = _prompts(vocab_size)
    assert sum(isinstance(m, RowParallelLinear) for m in ranks.runners[0].model.modules()) == 4  # 2 layers
    heads = [runner.model.lm_head for runner in ranks.runners]
    assert all(isinstance(head, VocabParallelLMHead) for head in heads)
    assert [(h.vocab.start, h.vocab.stop) for h in heads] == [(0, (vocab_size + 1) // 2), ((vocab_size + 1) // 2,
                                                                                          vocab_size)]
    params = SamplingParams(temperature=0.0, logprobs=3)
    single = make_runner(model_dir, block_size=4)
    logits = {"tp1": _record_logits(single), "tp2": _record_logits(ranks.runners[0]),
              "rank1": _record_logits(ranks.runners[1])}
    outputs = {}
    for name, runner in (("tp1", single), ("tp2", ranks)):
        scheduler = MiniScheduler(block_size=4, token_budget=16)
        for req_id, prompt in prompts.items():
            scheduler.add(req_id, prompt, max_tokens=8, params=params)
        logprobs: dict[str, list] = {req_id: [] for req_id in prompts}
        for _ in range(200):
            if scheduler.is_done():
                break
            so = scheduler.schedule()
            out = runner.execute_model(so)
            for req_id, lp in zip(out.req_ids, out.logprobs):
                if lp is not None:
                    logprobs[req_id].append(lp)
            scheduler.update(so, out)
        outputs[name] = ({r: scheduler.outputs(r) for r in prompts}, logprobs)
    assert len(logits["tp2"]) == len(logits["tp1"]) == len(logits["rank1"]) > 0
    for ours, theirs in zip(logits["tp2"], logits["tp1"], strict=True):
        assert ours.shape == theirs.shape == (theirs.shape[0], vocab_size)
        assert (ours - theirs).abs().max().item() < 1e-4
    assert logits["rank1"] == [None] * len(logits["tp1"])
    for req_id, prompt in prompts.items():
        assert outputs["tp2"][0][req_id] == hf_greedy(model_dir, prompt, 8), req_id
    assert outputs["tp2"][0] == outputs["tp1"][0]
    for req_id in prompts:
        for ours, theirs in zip(outputs["tp2"][1][req_id], outputs["tp1"][1][req_id], strict=True):
            assert abs(ours.logprob - theirs.logprob) < 1e-4
            assert [t for t, _ in ours.top_logprobs] == [t for t, _ in theirs.top_logprobs]
            assert max(abs(a - b) for (_, a), (_, b) in zip(ours.top_logprobs, theirs.top_logprobs)) < 1e-4
    rank1 = ranks.runners[1]
    assert {r: rank1.requests[r].output_token_ids for r in rank1.requests} == \
        {r: ranks.runners[0].requests[r].output_token_ids for r in ranks.runners[0].requests}
    assert ranks.last_rank1_output.logprobs == [None] * len(ranks.last_rank1_output.req_ids)  # no logits there


def test_a_tied_head_slice_is_a_view_of_the_embedding_packed_on_its_own(tiny_tied_odd_vocab_dir, tiny_llama_dir):
    """Tied: each rank's head weight is its rows of the (replicated, full) embedding matrix, no copy,
    and the CPU prepack packs those rows alone. Untied: the rank holds only its rows, packed."""
    ranks = TwoRanks(tiny_tied_odd_vocab_dir)
    try:
        for runner in ranks.runners:
            model = runner.model
            embedding, head = model.model.embed_tokens.weight, model.lm_head
            assert head.is_tied and embedding.shape == (ODD_VOCAB_SIZE, 64)
            assert head.weight.shape == (len(head.vocab), 64)
            assert head.weight.data_ptr() == embedding[head.vocab.start].data_ptr()
            assert head.weight.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
            assert head.weight_is_packed and head.packed_weight.shape == head.weight.shape
            assert "lm_head.weight" not in dict(model.named_parameters())
    finally:
        ranks.close()
    ranks = TwoRanks(tiny_llama_dir)
    try:
        for runner in ranks.runners:
            head = runner.model.lm_head
            assert not head.is_tied and head.weight_is_packed and head.weight.numel() == 0  # plain copy freed
            assert head.packed_weight.shape == (256, 64)
    finally:
        ranks.close()


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
