"""The greedy parity oracle's own rule, on made-up references (and one real continuation): a logit
tie lets our token differ only if it is transformers' runner-up, and the rest is still compared."""
from __future__ import annotations

import pytest
import torch

from tests.e2e import parity
from tests.e2e.parity import TIE_GAP, Reference, assert_greedy_match

VOCAB = 8


def _logits(first: int, second: int, gap: float, third: int | None = None) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[first], row[second] = 5.0, 5.0 - gap
    if third is not None:
        row[third] = 5.0 - 2 * gap
    return row


def _reference(tokens: list[int], tie_at: int | None = None, runner_up: int = 0, gap: float = TIE_GAP / 2,
               continuation: list[int] | None = None, max_new_tokens: int | None = None) -> Reference:
    """HF's greedy `tokens`, confident everywhere except at `tie_at` (top two within `gap`, `runner_up`
    second, token 7 third); from our token there, HF continues with `continuation`."""
    logits = [_logits(t, 7 if t != 7 else 6, 3.0) for t in tokens]
    if tie_at is not None:
        logits[tie_at] = _logits(tokens[tie_at], runner_up, gap, third=7)
    limit = max_new_tokens or len(tokens)

    def continue_from(ids: list[int], n: int) -> Reference:
        assert ids[:3] == [100, 101, 102] and n == limit - (len(ids) - 3)
        rest = (continuation or [])[:n]
        return Reference(ids, rest, [_logits(t, 7 if t != 7 else 6, 3.0) for t in rest], n, continue_from)

    return Reference([100, 101, 102], tokens, logits, limit, continue_from)


@pytest.fixture(autouse=True)
def _clear_tie_hits():
    parity.TIE_HITS.clear()
    yield
    parity.TIE_HITS.clear()


def test_identical_outputs_pass_and_record_no_tie():
    assert_greedy_match([1, 2, 3, 4], _reference([1, 2, 3, 4]), "same")
    assert parity.TIE_HITS == []


def test_a_difference_without_a_tie_fails():
    with pytest.raises(AssertionError, match="token 2 differs"):
        assert_greedy_match([1, 2, 5, 4], _reference([1, 2, 3, 4]), "no tie")


def test_a_tie_taken_by_a_token_that_is_not_the_runner_up_fails():
    # HF: 3 first, 5 second within the gap, 7 third. Ours took 7.
    ref = _reference([1, 2, 3, 4], tie_at=2, runner_up=5, continuation=[4])
    with pytest.raises(AssertionError, match="HF runner-up 5"):
        assert_greedy_match([1, 2, 7, 4], ref, "third choice")


def test_a_tie_taken_by_the_runner_up_continues_against_hf_continuation():
    ref = _reference([1, 2, 3, 4, 4], tie_at=2, runner_up=5, continuation=[6, 6])
    assert_greedy_match([1, 2, 5, 6, 6], ref, "runner-up")
    assert len(parity.TIE_HITS) == 1 and "runner-up: token 2" in parity.TIE_HITS[0]


def test_a_divergence_after_a_tie_still_fails():
    """Before, the comparison stopped at the tie and this passed with two tokens unchecked."""
    ref = _reference([1, 2, 3, 4, 4], tie_at=2, runner_up=5, continuation=[6, 6])
    with pytest.raises(AssertionError, match="token 4 differs"):
        assert_greedy_match([1, 2, 5, 6, 1], ref, "late divergence")


def test_a_length_difference_after_a_tie_fails():
    ref = _reference([1, 2, 3, 4, 4], tie_at=2, runner_up=5, continuation=[6, 6])
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_greedy_match([1, 2, 5, 6], ref, "short")


def test_a_wide_gap_is_no_tie_even_for_the_runner_up():
    ref = _reference([1, 2, 3, 4], tie_at=2, runner_up=5, gap=TIE_GAP * 10, continuation=[4])
    with pytest.raises(AssertionError, match="token 2 differs"):
        assert_greedy_match([1, 2, 5, 4], ref, "wide gap")


def test_the_continuation_may_run_past_an_early_eos_of_the_first_reference():
    # HF ended on EOS (2) after 3 of 6 tokens; from our runner-up it goes on for the remaining 5.
    ref = _reference([1, 3, 2], tie_at=1, runner_up=5, continuation=[6, 6, 6, 6, 6], max_new_tokens=6)
    assert_greedy_match([1, 5, 6, 6, 6, 6], ref, "past eos")


def test_the_real_continuation_is_transformers_greedy_from_our_token(monkeypatch):
    """With a real (tiny random) model: the continuation after a forced runner-up is what generate
    gives from that prefix."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64)).eval()
    model.generation_config.eos_token_id = None
    ref = parity.hf_greedy(model, [3, 4, 5, 6], 12)
    runner_up = int(torch.topk(ref.step_logits[0], 2).indices[1])
    tail = parity.hf_greedy(model, [3, 4, 5, 6, runner_up], 11).output_token_ids
    monkeypatch.setattr(parity, "TIE_GAP", float("inf"))  # every step counts as a tie here
    assert_greedy_match([runner_up] + tail, ref, "real")
    assert len(parity.TIE_HITS) == 1  # one tie taken: the other 11 tokens matched the continuation exactly
