"""A step's sampling inputs, sliced from the persistent batch's per-row arrays (input_batch.py).

Tensors are materialised only for the knobs the step's rows use; when no row of the whole batch
uses any, the metadata is the greedy fast path's and no array is even indexed. On a device, the
step's knob values cross in at most two host-to-device copies: the float knobs (all six, gathered
by one index) and the integer ones. Logit bias, min_tokens bans and the penalties' token history
stay host arrays: each sampler turns them into what it needs (dense index lists, or the CUDA
kernel's sparse entries) and copies that once, so nothing goes to the device and back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.input_batch import FREQUENCY, MIN_P, PRESENCE, REPETITION, TEMPERATURE, TOP_P, InputBatch, Knob


@dataclass(frozen=True)
class PenaltyMetadata:
    presence: torch.Tensor  # [N, 1]
    frequency: torch.Tensor  # [N, 1]
    repetition: torch.Tensor  # [N, 1]
    # Host arrays for the P rows that have a penalty (the others' factors are neutral):
    rows: np.ndarray  # [P] int64, their logits rows
    prompt_token_ids: np.ndarray  # [P, L] int64, -1 past the row's prompt
    output_token_ids: np.ndarray  # [P, L] int64, -1 where the row has no output token


@dataclass(frozen=True)
class SamplingMetadata:
    """Row i describes logits row i. A None field means no row of the step uses that knob."""

    all_greedy: bool
    is_greedy: torch.Tensor | None = None  # [N] bool, None when all rows are greedy or all random
    temperature: torch.Tensor | None = None  # [N, 1], 1.0 on greedy rows; None when all greedy
    top_k: torch.Tensor | None = None  # [N] int64, vocab size where disabled
    top_p: torch.Tensor | None = None  # [N] float
    min_p: torch.Tensor | None = None  # [N] float
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded random rows
    num_logprobs: list[int | None] | None = None  # per row (None: not requested); None if no row asks
    max_num_logprobs: int | None = None
    # Logits processors (see logits_processors.py), host arrays:
    logit_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # rows, token ids, biases (float32)
    banned: tuple[np.ndarray, np.ndarray] | None = None  # rows, token ids (min_tokens not reached)
    penalties: PenaltyMetadata | None = None


def build_sampling_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Logits row i samples for the request in persistent-batch row `rows[i]`."""
    if not batch.num_rows_using.any():
        return SamplingMetadata(all_greedy=True)
    flags = batch.knob_flags_cpu[:, rows]
    in_use = flags.any(axis=1)
    all_greedy = not in_use[Knob.RANDOM]
    ints = {}  # the step's integer knobs, for one copy
    if not all_greedy and not flags[Knob.RANDOM].all():
        ints["is_greedy"] = ~flags[Knob.RANDOM]
    if in_use[Knob.TOP_K]:
        top_k = batch.top_k_cpu[rows]
        is_on = (top_k > 0) & (top_k < vocab_size)
        if (is_on & flags[Knob.TOP_K]).any():
            ints["top_k"] = np.where(is_on, top_k, vocab_size)
    has_penalties = in_use[Knob.PENALTIES]
    floats = None  # all six float knobs of the step's rows: one gather, one copy
    if not all_greedy or has_penalties:
        floats = _to_device(batch.float_knobs_cpu.take(rows, axis=1), device)
    if ints:
        ints = dict(zip(ints, _to_device(np.stack([v.astype(np.int64) for v in ints.values()]), device)))
    num_logprobs = max_num_logprobs = None
    if in_use[Knob.LOGPROBS]:
        counts = batch.num_logprobs_cpu[rows]
        num_logprobs, max_num_logprobs = [n if n >= 0 else None for n in counts.tolist()], int(counts.max())
    return SamplingMetadata(
        all_greedy=all_greedy,
        is_greedy=ints["is_greedy"].bool() if "is_greedy" in ints else None,
        temperature=None if all_greedy else floats[TEMPERATURE, :, None],
        top_k=ints.get("top_k"),
        top_p=floats[TOP_P] if in_use[Knob.TOP_P] else None,
        min_p=floats[MIN_P] if in_use[Knob.MIN_P] else None,
        generators=_generators(batch, rows, flags[Knob.SEEDED]) if in_use[Knob.SEEDED] else {},
        num_logprobs=num_logprobs,
        max_num_logprobs=max_num_logprobs,
        logit_bias=_logit_bias(batch, rows, flags[Knob.LOGIT_BIAS]) if in_use[Knob.LOGIT_BIAS] else None,
        banned=_banned(batch, rows, flags[Knob.MIN_TOKENS], eos_token_ids) if in_use[Knob.MIN_TOKENS] else None,
        penalties=_penalties(batch, rows, flags[Knob.PENALTIES], floats) if has_penalties else None,
    )


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """One copy of a step's gathered knob values (already a fresh array: no view of the batch)."""
    return torch.from_numpy(values).to(device)


def _generators(batch: InputBatch, rows: np.ndarray, is_seeded: np.ndarray) -> dict[int, torch.Generator]:
    return {int(i): batch.generators[int(rows[i])] for i in np.flatnonzero(is_seeded)}


def _logit_bias(batch: InputBatch, rows: np.ndarray, has_bias: np.ndarray):
    biased = np.flatnonzero(has_bias)
    entries = [batch.logit_bias[int(rows[i])] for i in biased]
    return (np.repeat(biased, [len(tokens) for tokens, _ in entries]),
            np.concatenate([tokens for tokens, _ in entries]), np.concatenate([biases for _, biases in entries]))


def _banned(batch: InputBatch, rows: np.ndarray, has_min_tokens: np.ndarray, eos_token_ids: tuple[int, ...]):
    """Stop tokens are banned while a request has fewer than min_tokens outputs."""
    num_output = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    short = np.flatnonzero(has_min_tokens & (num_output < batch.min_tokens_cpu[rows]))
    stop_ids = []
    for i in short.tolist():  # only rows still short of min_tokens: the first few steps of a few requests
        p = batch.requests[int(rows[i])].sampling_params
        stop_ids.append(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))))
    if not any(stop_ids):
        return None
    return (np.repeat(short, [len(ids) for ids in stop_ids]),
            np.fromiter((t for ids in stop_ids for t in ids), dtype=np.int64))


def _penalties(batch: InputBatch, rows: np.ndarray, has_penalty: np.ndarray, floats: torch.Tensor) -> PenaltyMetadata:
    penalised = np.arange(len(rows)) if has_penalty.all() else np.flatnonzero(has_penalty)
    batch_rows = rows[penalised]
    num_prompt = batch.num_prompt_tokens[batch_rows][:, None]
    num_tokens = batch.num_tokens[batch_rows][:, None]
    token_ids = batch.token_ids_cpu[batch_rows, : int(num_tokens.max())]
    positions = np.arange(token_ids.shape[1])
    return PenaltyMetadata(
        presence=floats[PRESENCE, :, None],
        frequency=floats[FREQUENCY, :, None],
        repetition=floats[REPETITION, :, None],
        rows=penalised,
        prompt_token_ids=np.where(positions < num_prompt, token_ids, -1),
        output_token_ids=np.where((positions >= num_prompt) & (positions < num_tokens), token_ids, -1),
    )
