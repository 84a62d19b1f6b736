"""Wrappers for the sampling kernels (sampling.cu) and the host side of the sparse processors.

Logit bias, penalties and min_tokens bans touch few tokens per row, so instead of dense
[N, vocab] count tensors the host merges them into one entry per (row, token) and the kernel
visits only those: no pass over the vocabulary at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker.kernels.launch import KernelLaunch, check_tensor, i32, i64
from services.worker.kernels.loader import SAMPLER_THREADS, SMALL_VOCAB

SEEN, BANNED = 1, 2  # entry flags, as in sampling.cu


@dataclass(frozen=True)
class SparseLogitEntries:
    """One entry per (row, token) that any processor touches; arrays of equal length."""

    rows: np.ndarray  # int32
    tokens: np.ndarray  # int32
    output_counts: np.ndarray  # int32: times the token appears in the row's output
    biases: np.ndarray  # float32
    flags: np.ndarray  # int32: SEEN | BANNED

    def __len__(self) -> int:
        return len(self.rows)

    def to(self, device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(a).to(device) for a in
                     (self.rows, self.tokens, self.output_counts, self.biases, self.flags))


def merge_entries(
    logit_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    banned: tuple[np.ndarray, np.ndarray] | None = None,
    penalty_tokens: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> SparseLogitEntries:
    """Merges logit biases (rows, tokens, biases), banned tokens (rows, tokens) and, when penalties
    apply, the penalised rows' tokens (rows [P], prompt [P, L], output [P, L], -1 where a row has
    no token) into unique (row, token) entries, ordered by row then token."""
    parts = []  # (rows, tokens, output counts, biases, flags), one per source

    def add(rows, tokens, count, bias, flag):
        n = len(rows)
        parts.append((rows, tokens, np.full(n, count), np.broadcast_to(bias, n), np.full(n, flag)))

    if logit_bias is not None:
        add(*logit_bias[:2], 0, logit_bias[2], 0)
    if banned is not None:
        add(*banned, 0, 0.0, BANNED)
    if penalty_tokens is not None:
        rows, prompt, output = penalty_tokens
        for token_ids, count in ((prompt, 0), (output, 1)):
            has_token = token_ids >= 0
            add(np.broadcast_to(rows[:, None], token_ids.shape)[has_token], token_ids[has_token], count, 0.0, SEEN)
    rows, tokens, counts, biases, flags = (np.concatenate(column) for column in zip(*parts)) if parts else \
        (np.zeros(0, dtype=np.int64),) * 5
    keys, entry = np.unique((rows.astype(np.int64) << 32) | tokens.astype(np.int64), return_inverse=True)
    num_entries = len(keys)

    def total(weights):
        return np.bincount(entry, weights=weights, minlength=num_entries)

    return SparseLogitEntries(
        rows=(keys >> 32).astype(np.int32),
        tokens=(keys & 0xFFFFFFFF).astype(np.int32),
        output_counts=total(counts).astype(np.int32),
        biases=total(biases).astype(np.float32),  # one bias per (row, token): the sum is exact
        flags=(SEEN * (total(flags & SEEN) > 0) | BANNED * (total(flags & BANNED) > 0)).astype(np.int32),
    )


def apply_sparse_logits(
    logits: torch.Tensor,
    entries: tuple[torch.Tensor, ...],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> KernelLaunch | None:
    """Adds biases, applies penalties (repetition, then frequency and presence) and bans, in place,
    on `logits` [N, vocab] float32, at the entries (rows, tokens, output_counts, biases, flags)
    on the logits' device; per-row penalty factors are [N] float32."""
    check_tensor("logits", logits, torch.float32, ndim=2, contiguous=False, inner_contiguous=True)
    rows, tokens, counts, biases, flags = entries
    for name, t, dtype in (("rows", rows, torch.int32), ("tokens", tokens, torch.int32),
                           ("output_counts", counts, torch.int32), ("biases", biases, torch.float32),
                           ("flags", flags, torch.int32)):
        check_tensor(name, t, dtype, ndim=1)
        if t.shape[0] != rows.shape[0]:
            raise ValueError("entry arrays differ in length")
    for name, t in (("presence", presence), ("frequency", frequency), ("repetition", repetition)):
        check_tensor(name, t, torch.float32, ndim=1)
        if t.shape[0] != logits.shape[0]:
            raise ValueError(f"{name}: {t.shape[0]} rows, logits have {logits.shape[0]}")
    num_entries = rows.shape[0]
    if num_entries == 0:
        return None
    return KernelLaunch(
        module="sampling",
        name="spindle::apply_sparse_logits<256>",
        grid=(-(-num_entries // 256), 1, 1),
        block=(256, 1, 1),
        args=(logits, i64(logits.stride(0)), rows, tokens, counts, biases, flags,
              presence, frequency, repetition, i32(num_entries)),
    )


def sample_rows(
    out_tokens: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> KernelLaunch | None:
    """One token per row of `logits` [N, vocab] float32 into `out_tokens` [N] int64.

    Per row ([N] each): temperature float32 (<= 0: greedy argmax), top_k int32 (<= 0 or >= vocab:
    off), top_p float32 (>= 1: off), min_p float32 (<= 0: off), seeds and offsets int64 holding
    the 64-bit Philox key and counter offset: the same (seed, offset) draws the same token.
    """
    check_tensor("logits", logits, torch.float32, ndim=2, contiguous=False, inner_contiguous=True)
    num_rows, vocab_size = logits.shape
    check_tensor("out_tokens", out_tokens, torch.int64, ndim=1)
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                           ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                           ("seeds", seeds, torch.int64), ("offsets", offsets, torch.int64)):
        check_tensor(name, t, dtype, ndim=1)
        if t.shape[0] != num_rows:
            raise ValueError(f"{name}: {t.shape[0]} rows, logits have {num_rows}")
    if out_tokens.shape[0] != num_rows:
        raise ValueError(f"out_tokens: {out_tokens.shape[0]} rows, logits have {num_rows}")
    if vocab_size >= 2**31 - 4:
        raise ValueError("vocabulary too large for int32 token ids")
    if num_rows == 0:
        return None
    threads = SAMPLER_THREADS[0] if vocab_size <= SMALL_VOCAB else SAMPLER_THREADS[1]
    return KernelLaunch(
        module="sampling",
        name=f"spindle::sample_rows<{threads}>",
        grid=(num_rows, 1, 1),
        block=(threads, 1, 1),
        args=(out_tokens, logits, i64(logits.stride(0)), i32(vocab_size), temperature, top_k, top_p, min_p,
              seeds, offsets),
    )
