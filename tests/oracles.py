"""References that share no code with the services, for the attention and sampling checks.

- Attention: a dense float64 attention written from the formula, softmax(q k^T * scale + causal
  mask) v, over each request's whole K/V history as the test generated it (never read back
  through a block table), with GQA by repeating KV heads.
- Sampling: Hugging Face transformers' `MinPLogitsWarper`, `TopKLogitsWarper` and
  `TopPLogitsWarper`, one row at a time with that row's knobs, in vLLM V1's order: temperature,
  then min-p, then top-k, then top-p. (transformers' own `generate` runs min-p last; with top-p
  that keeps a different set, so the order is part of the reference.)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

# --- attention ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DenseRequest:
    """One request of a step: its whole K/V history [L, H_kv, D] (earlier context, then this
    step's tokens) and how many of its last positions are this step's queries."""

    keys: torch.Tensor
    values: torch.Tensor
    query_len: int

    @property
    def context_len(self) -> int:
        return self.keys.shape[0] - self.query_len


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int,
                    scale: float) -> torch.Tensor:
    """query [n, H, D] at absolute positions context_len .. context_len + n - 1, keys/values
    [L, H_kv, D] at positions 0 .. L - 1 -> [n, H * D] float64. Query i sees keys j <= its position."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    q = query.double()
    # query head h reads KV head h // group
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, n, L]
    q_pos = torch.arange(context_len, context_len + n)[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    # softmax written out, in float64: exp(s - max) / sum
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", weights, v).reshape(n, num_heads * head_dim)


def batch_dense_attention(query: torch.Tensor, requests: Sequence[DenseRequest], scale: float,
                          attention: AttentionFn = dense_attention) -> torch.Tensor:
    """A flat batch [T, H, D] whose requests own consecutive query rows, in order -> [T, H * D]."""
    assert sum(r.query_len for r in requests) == query.shape[0]
    out, start = [], 0
    for r in requests:
        out.append(attention(query[start:start + r.query_len], r.keys, r.values, r.context_len, scale))
        start += r.query_len
    return torch.cat(out)


def check_attention(actual: torch.Tensor, query: torch.Tensor, requests: Sequence[DenseRequest], scale: float,
                    tol: float, attention: AttentionFn = dense_attention) -> None:
    """Raises AssertionError unless `actual` [T, H * D] is within `tol` (absolute and relative)
    of the reference, request by request (the message names the first request that is off)."""
    expected = batch_dense_attention(query, requests, scale, attention)
    actual = actual.reshape(expected.shape).double()
    start = 0
    for i, r in enumerate(requests):
        rows = slice(start, start + r.query_len)
        torch.testing.assert_close(
            actual[rows], expected[rows], atol=tol, rtol=tol,
            msg=lambda m, i=i, r=r: f"request {i} (context {r.context_len}, {r.query_len} queries): {m}")
        start += r.query_len


# --- sampling -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowKnobs:
    """One row's knobs, with the off values vLLM uses: top_k 0 (or >= vocab), top_p 1, min_p 0."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def warp_row(logits: torch.Tensor, knobs: RowKnobs) -> torch.Tensor:
    """One row [V] -> float64 logits / T with the filtered tokens at -inf."""
    scores = (logits.double() / knobs.temperature)[None]
    no_ids = torch.empty(1, 0, dtype=torch.long)
    if knobs.min_p > 0.0:
        scores = MinPLogitsWarper(float(knobs.min_p))(no_ids, scores)
    if 0 < knobs.top_k < scores.shape[1]:
        scores = TopKLogitsWarper(int(knobs.top_k))(no_ids, scores)
    if knobs.top_p < 1.0:
        scores = TopPLogitsWarper(float(knobs.top_p))(no_ids, scores)
    return scores[0]


def reference_logits(logits: torch.Tensor, knobs: Sequence[RowKnobs]) -> torch.Tensor:
    """[N, V] -> [N, V] float64: each row warped with its own knobs."""
    assert logits.shape[0] == len(knobs)
    return torch.stack([warp_row(row, k) for row, k in zip(logits, knobs)])


def reference_kept(logits: torch.Tensor, knobs: Sequence[RowKnobs]) -> torch.Tensor:
    """[N, V] bool: the tokens each row may draw."""
    return torch.isfinite(reference_logits(logits, knobs))


def reference_probs(logits: torch.Tensor, knobs: Sequence[RowKnobs]) -> torch.Tensor:
    """[N, V] float64: the renormalised distribution over the kept tokens."""
    return torch.softmax(reference_logits(logits, knobs), dim=-1)


def check_kept_sets(kept: torch.Tensor, expected: torch.Tensor) -> None:
    """Raises AssertionError unless the kept sets [N, V] (bool) are the same, row by row."""
    assert kept.shape == expected.shape, (kept.shape, expected.shape)
    problems = []
    for row in range(kept.shape[0]):
        missing = (expected[row] & ~kept[row]).nonzero().flatten().tolist()
        extra = (kept[row] & ~expected[row]).nonzero().flatten().tolist()
        if missing or extra:
            problems.append(f"row {row}: {int(expected[row].sum())} tokens expected, "
                            f"missing {missing[:8]}, extra {extra[:8]}")
    assert not problems, "kept sets differ from the transformers warpers:\n" + "\n".join(problems)
