"""Token sampling from the logits of one step.

`TorchSampler` steps, in order:
1. logits to float32; logprobs (raw, before any processing) only if some row asks for them;
2. logits processors: logit bias, penalties, min_tokens bans;
3. greedy argmax; if every row is greedy, done (the fast path);
4. temperature, then min-p, then top-k and top-p, each only if some row uses it;
5. a draw per row by the exponential race (argmax of p / q, q ~ Exp(1)), with seeded rows drawing
   their noise from their own generator, so a seed gives the same tokens wherever its request
   sits in the batch and whatever else runs with it;
6. greedy rows take the argmax, others the draw.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

import torch

from services.common.messages import TokenLogprobs
from services.worker.logits_processors import apply_logits_processors
from services.worker.sampling_metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where not requested


class Sampler(abc.ABC):
    @abc.abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Picks one token per row of `logits` [N, vocab] as `metadata` row i says."""

    @abc.abstractmethod
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, row_indices: list[int]) -> None:
        """Sets to -inf, in place, every token a grammar forbids, before sampling.

        `logits` is float32 [N, vocab] on the sampler's device; `bitmask` a host int32 tensor
        [N, ceil(vocab / 32)] in xgrammar's layout (bit t % 32 of word t // 32 is 1 where token t
        is allowed), row i for logits row i. Only the rows in `row_indices` (ascending, unique)
        are constrained; the others, and their bitmask rows, are left untouched.
        """


class TorchSampler(Sampler):
    def __init__(self, token_bitmask: Callable[[torch.Tensor, torch.Tensor, list[int]], None] | None = None,
                 greedy_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`token_bitmask`: a compiled `apply_token_bitmask` (cpu_bitmask.py); None: xgrammar's CPU function.
        `greedy_argmax`: a compiled argmax over bfloat16 logits rows (cpu_argmax.py) for steps where every
        row is greedy and nothing else reads the logits; None: the float32 path below for every step."""
        self._token_bitmask = token_bitmask or apply_token_bitmask_cpu
        self._greedy_argmax = greedy_argmax

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if (self._greedy_argmax is not None and logits.dtype == torch.bfloat16 and logits.is_contiguous()
                and argmax_only(metadata)):
            # The float32 widening is exact, so its argmax is this one; skipping it saves the copy.
            return SamplerOutput(self._greedy_argmax(logits).tolist(), [None] * logits.shape[0])
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_logits_processors(logits, metadata)
        # max's indices are argmax's (the first maximum, NaN counted as one) at a third of its CPU time
        # (0.66 against 1.7 ms for 48 rows of a 49,152-token vocabulary on Sapphire Rapids).
        greedy = logits.max(dim=-1).indices
        if metadata.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample_random(logits, metadata)
            if metadata.is_greedy is not None:
                sampled = torch.where(metadata.is_greedy, greedy, sampled)
        token_ids = sampled.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, row_indices: list[int]) -> None:
        self._token_bitmask(logits, bitmask, row_indices)

    @staticmethod
    def _sample_random(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        logits = logits / m.temperature
        if m.min_p is not None:
            logits = apply_min_p(logits, m.min_p)
        if m.top_k is not None or m.top_p is not None:
            logits = apply_top_k_top_p(logits, m.top_k, m.top_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        if len(m.generators) < probs.shape[0]:
            noise.exponential_()
        for row, generator in m.generators.items():
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: list[int]) -> None:
    """The grammar library's CPU function (xgrammar's, in C++): for 32 rows of SmolLM2's 49,152
    tokens 0.04 ms when nearly all are allowed, 3.5 to 6.4 ms when few are (the compiled kernel of
    cpu_bitmask.py: about 0.2 ms)."""
    import xgrammar  # imported by the first constrained step only

    vocab_size = logits.shape[1]
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=row_indices)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's top_k most likely tokens, then the smallest set whose mass reaches top_p."""
    if top_p is None:
        # top-k alone: a k-th largest threshold per row, no full sort. Rows without top-k (k = vocab
        # size) get no threshold, so they do not make every row pay for a top-k of the whole vocabulary.
        is_enabled = top_k < logits.shape[1]
        if not bool(is_enabled.any()):
            return logits
        max_k = int(top_k[is_enabled].max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).clamp(max=max_k - 1)[:, None])
        kth = kth.masked_fill(~is_enabled[:, None], float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Mass strictly before each token; the first token is always kept. A row without top-p (1) is
    # never cut: its float32 running mass can reach 1.0 before the vocabulary's end.
    mass_before = probs.cumsum(dim=-1) - probs
    is_cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(is_cut, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def argmax_only(metadata: SamplingMetadata) -> bool:
    """Every row greedy, and no logprobs or logits processor reads or changes the logits."""
    return (metadata.all_greedy and metadata.max_num_logprobs is None and metadata.logit_bias is None
            and metadata.banned is None and metadata.penalties is None)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """Logprob and 1-based rank of each sampled token, plus its row's top alternatives."""
    sampled_lp = logprobs.gather(1, sampled[:, None])
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    max_k = max(n for n in num_logprobs if n is not None)
    top_values = top_ids = None
    if max_k > 0:
        top = logprobs.topk(max_k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    sampled_lp, ranks = sampled_lp[:, 0].tolist(), ranks.tolist()
    out: list[TokenLogprobs | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        alternatives = list(zip(top_ids[i][:n], top_values[i][:n])) if n > 0 else []
        out.append(TokenLogprobs(logprob=sampled_lp[i], rank=ranks[i], top_logprobs=alternatives))
    return out
