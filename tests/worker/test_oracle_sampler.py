"""TorchSampler's filtering (apply_min_p, apply_top_k_top_p) against the transformers warpers of
tests/oracles.py: random rows over a vocabulary of 4096, per-row knobs with disabled values among
them, each batch taking the code path its knobs select (top-k alone skips the sort). The kept
sets are read from the sampler's own calls, so the order it applies them in (temperature, min-p,
top-k, top-p, as vLLM V1) is what is checked. Broken copies (top-p one token short, top-k one
token long) and transformers generate's own order (min-p last) must fail the same check."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from services.common.messages import SamplingParams
from services.worker import sampler
from tests.worker.sampling_batch import metadata_for
from tests.oracles import RowKnobs, check_kept_sets, reference_kept

VOCAB = 4096
K = RowKnobs
BATCHES = {
    # top-k only: the threshold path without a sort; -1, 0 and the vocabulary size are "off"
    "top_k": [K(1.0, 1), K(1.0, 5), K(1.3, 40), K(1.0, 0), K(0.9, 300), K(2.0, VOCAB), K(1.1, -1), K(1.0, 2)],
    "top_p": [K(0.7, top_p=0.5), K(1.0, top_p=0.9), K(1.5, top_p=0.99), K(1.0, top_p=0.999), K(0.8, top_p=0.05),
              K(1.2, top_p=0.75), K(1.0, top_p=0.3), K(2.0, top_p=0.95)],
    "min_p": [K(1.0, min_p=0.1), K(0.7, min_p=0.01), K(1.5, min_p=0.5), K(1.0), K(2.0, min_p=0.001),
              K(1.0, min_p=0.9), K(0.9, min_p=0.05), K(1.2, min_p=0.2)],
    "all": [K(1.3, 50, 0.9, 0.05), K(0.8, 0, 0.6, 0.0), K(1.0, VOCAB, 0.95, 0.0), K(0.5, 20, 1.0, 0.1),
            K(2.0, 0, 0.3, 0.02), K(1.0, 7, 0.8, 0.0), K(1.5, 0, 1.0, 0.3), K(0.9, 500, 0.99, 0.001),
            K(1.1, 3, 0.05, 0.0), K(1.0, 0, 0.9, 0.5), K(1.0), K(2.5, 100, 0.97, 0.01)],
}


def _logits(rows: int, seed: int) -> torch.Tensor:
    # Random floats: no two logits tie, so every kept set is defined without a tie rule.
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sampler_kept(logits: torch.Tensor, knobs: list[RowKnobs], monkeypatch) -> torch.Tensor:
    """Runs TorchSampler on the batch and returns what its last filter kept, [N, V] bool."""
    calls = []

    def spy(name, fn):
        def wrapped(x, *args):
            out = fn(x, *args)
            calls.append((name, x.clone(), out.clone()))
            return out
        return wrapped

    monkeypatch.setattr(sampler, "apply_min_p", spy("min_p", sampler.apply_min_p))
    monkeypatch.setattr(sampler, "apply_top_k_top_p", spy("top_k_top_p", sampler.apply_top_k_top_p))
    params = [SamplingParams(temperature=k.temperature, top_k=k.top_k, top_p=k.top_p, min_p=k.min_p) for k in knobs]
    metadata = metadata_for(params, [None] * len(params), [[]] * len(params), [[]] * len(params), (), VOCAB)
    sampler.TorchSampler()(logits.clone(), metadata)
    names = [name for name, _, _ in calls]
    uses_min_p = any(k.min_p > 0 for k in knobs)
    uses_k_or_p = any(0 < k.top_k < VOCAB or k.top_p < 1 for k in knobs)
    assert names == ["min_p"] * uses_min_p + ["top_k_top_p"] * uses_k_or_p  # vLLM's order
    temperature = torch.tensor([k.temperature for k in knobs])[:, None]
    assert torch.equal(calls[0][1], logits / temperature)  # temperature first
    if len(calls) == 2:
        assert torch.equal(calls[1][1], calls[0][2])  # top-k/top-p on what min-p kept
    return torch.isfinite(calls[-1][2])


def _is_off(k: RowKnobs) -> bool:
    return not (0 < k.top_k < VOCAB) and k.top_p >= 1 and k.min_p <= 0


@pytest.mark.parametrize("batch", BATCHES)
def test_kept_sets_match_the_transformers_warpers(batch, monkeypatch):
    knobs = BATCHES[batch]
    logits = _logits(len(knobs), seed=len(batch))
    kept = sampler_kept(logits, knobs, monkeypatch)
    expected = reference_kept(logits, knobs)
    check_kept_sets(kept, expected)
    # the data exercise something: every row with a knob on loses tokens, the others none
    sizes = expected.sum(-1).tolist()
    assert [s == VOCAB for s in sizes] == [_is_off(k) for k in knobs], sizes


def test_a_row_without_top_p_keeps_every_token_next_to_top_p_rows(monkeypatch):
    """Once a bug: a top_p = 1 row batched with top-p rows was cut where its float32 running mass
    reached 1.0, dropping tail tokens (4096 vocab: 49 tokens; 151936: 17344)."""
    knobs = [K(1.0, top_p=0.9), K(1.0), K(0.7, top_p=0.5), K(1.5)]
    logits = _logits(len(knobs), seed=5)
    check_kept_sets(sampler_kept(logits, knobs, monkeypatch), reference_kept(logits, knobs))


def _top_p_one_short(logits, top_k, top_p):
    """A top-p that cuts at the inclusive cumulative mass: it drops the token that crosses top_p."""
    if top_k is not None:
        logits = _original_top_k_top_p(logits, top_k, None)
    if top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) > top_p[:, None]
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _top_k_one_long(logits, top_k, top_p):
    """A top-k that keeps k + 1 tokens where it is on."""
    if top_k is not None:
        top_k = torch.where(top_k < logits.shape[1], top_k + 1, top_k)
    return _original_top_k_top_p(logits, top_k, top_p)


_original_top_k_top_p = sampler.apply_top_k_top_p


@pytest.mark.parametrize("broken,batch", [(_top_p_one_short, "top_p"), (_top_p_one_short, "all"),
                                          (_top_k_one_long, "top_k"), (_top_k_one_long, "all")],
                         ids=("top_p_one_short", "top_p_one_short-all", "top_k_one_long", "top_k_one_long-all"))
def test_a_broken_filter_fails_the_check(broken, batch, monkeypatch):
    knobs = BATCHES[batch]
    logits = _logits(len(knobs), seed=len(batch))
    monkeypatch.setattr(sampler, "apply_top_k_top_p", broken)
    kept = sampler_kept(logits, knobs, monkeypatch)
    with pytest.raises(AssertionError, match="kept sets differ"):
        check_kept_sets(kept, reference_kept(logits, knobs))


def test_min_p_last_keeps_a_different_set():
    """transformers generate applies min-p after top-k/top-p; with top-p the kept set differs, so
    a sampler in that order would fail the check against vLLM's order."""
    knobs = BATCHES["all"]
    logits = _logits(len(knobs), seed=len("all"))
    no_ids = torch.empty(1, 0, dtype=torch.long)
    rows = []
    for row, k in zip(logits, knobs):
        scores = (row.double() / k.temperature)[None]
        if 0 < k.top_k < VOCAB:
            scores = TopKLogitsWarper(k.top_k)(no_ids, scores)
        if k.top_p < 1:
            scores = TopPLogitsWarper(k.top_p)(no_ids, scores)
        if k.min_p > 0:
            scores = MinPLogitsWarper(k.min_p)(no_ids, scores)
        rows.append(torch.isfinite(scores[0]))
    with pytest.raises(AssertionError, match="kept sets differ"):
        check_kept_sets(torch.stack(rows), reference_kept(logits, knobs))
