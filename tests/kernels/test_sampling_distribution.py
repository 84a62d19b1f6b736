"""Chi-square tests: over many seeded draws on a small vocabulary, the kernel's token frequencies
follow the probabilities the transformers warpers assign (tests/oracles.py, in vLLM's order:
temperature, min-p, top-k, top-p), for each knob alone and combined; and draws from the wrong
distribution are told apart (the test has power)."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopPLogitsWarper

from services.worker.kernels import sampling_ops
from tests.oracles import RowKnobs, reference_probs as warper_probs

NUM_DRAWS = 3000
VOCAB = 12


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= observed) with the support's size - 1 degrees of freedom (support: probs > 0)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the reference gives probability 0"
    expected = probs[support].double() * counts.sum()
    observed = counts[support].double()
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def reference_probs(logits, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    knobs = RowKnobs(temperature, top_k or 0, 1.0 if top_p is None else top_p, min_p or 0.0)
    return warper_probs(logits[None], [knobs])[0]


def kernel_counts(shim, logits, temperature, top_k=0, top_p=1.0, min_p=0.0, seed_base=0) -> torch.Tensor:
    n = NUM_DRAWS
    out = torch.empty(n, dtype=torch.int64)
    shim(sampling_ops.sample_rows(
        out, logits.expand(n, -1).contiguous(), torch.full((n,), float(temperature)),
        torch.full((n,), top_k, dtype=torch.int32), torch.full((n,), float(top_p)), torch.full((n,), float(min_p)),
        torch.arange(seed_base, seed_base + n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)))
    return torch.bincount(out, minlength=logits.shape[0])


LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.6, 0.3, 0.0, -0.4, -0.8, -1.5, -2.5, -4.0])
CASES = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=2.0),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.15),
    "combined": dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
    # top-p over what min-p kept: 4 tokens; min-p after top-p (transformers generate's order): 5
    "min_p_then_top_p": dict(temperature=1.0, top_p=0.8, min_p=0.1),
}


@pytest.mark.parametrize("case", CASES)
def test_frequencies_follow_the_reference_probabilities(shim, case):
    knobs = CASES[case]
    probs = reference_probs(LOGITS, knobs["temperature"], knobs.get("top_k"), knobs.get("top_p"), knobs.get("min_p"))
    counts = kernel_counts(shim, LOGITS, **knobs)
    p_value = chi_square_p_value(counts, probs)
    assert p_value > 1e-3, f"{case}: p = {p_value:.2e}, counts {counts.tolist()} vs {(probs * NUM_DRAWS).tolist()}"


def test_the_chi_square_test_rejects_the_wrong_distribution(shim):
    """Power check: draws at temperature 0.7 are rejected against temperature 1.0's probabilities."""
    counts = kernel_counts(shim, LOGITS, temperature=0.7, seed_base=10**6)
    assert chi_square_p_value(counts, reference_probs(LOGITS, 1.0)) < 1e-6


def test_the_chi_square_test_sees_the_order_of_min_p_and_top_p(shim):
    """Draws with min-p and top-p are rejected against transformers generate's order (min-p
    last), whose kept set has one token more."""
    counts = kernel_counts(shim, LOGITS, **CASES["min_p_then_top_p"], seed_base=2 * 10**6)
    no_ids = torch.empty(1, 0, dtype=torch.long)
    scores = TopPLogitsWarper(0.8)(no_ids, LOGITS[None].double())
    min_p_last = torch.softmax(MinPLogitsWarper(0.1)(no_ids, scores), dim=-1)[0]
    assert chi_square_p_value(counts, min_p_last) < 1e-6
