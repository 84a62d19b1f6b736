"""The GPU sampler: the same steps as `TorchSampler` (sampler.py), run by the sampling kernels.

1. logits to float32; raw logprobs (PyTorch, before processing) only if some row asks;
2. logit bias, penalties and min_tokens bans: one sparse kernel over the touched (row, token)
   entries, merged on the host from the metadata's host arrays and copied in once;
3. one kernel, one CTA per row: greedy argmax, or temperature + min-p + top-k + top-p and a draw
   by the exponential race with Philox noise. A seeded request's noise is keyed by its seed and a
   per-request counter that advances every step, so it draws the same tokens wherever it sits in
   the batch; unseeded rows get fresh 64-bit keys from the device's default generator.

Nothing read back from the device feeds a later launch: the knobs arrive as device tensors, the
processors' entries and the seeded rows' keys are built on the host and copied in, and the only
device-to-host copies are the results (sampled tokens, logprobs).
"""
from __future__ import annotations

import numpy as np
import torch

from services.worker.kernels import bitmask_ops, sampling_ops
from services.worker.kernels.launch import Launcher
from services.worker.sampler import Sampler, SamplerOutput, gather_logprobs
from services.worker.sampling_metadata import SamplingMetadata


class CudaSampler(Sampler):
    def __init__(self, launcher: Launcher):
        self.launcher = launcher

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        num_rows, vocab_size = logits.shape
        device = logits.device
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        entries = _sparse_entries(metadata)
        if len(entries):  # in place, as TorchSampler's processors are
            presence, frequency, repetition = _penalty_columns(metadata, num_rows, device)
            self._launch(sampling_ops.apply_sparse_logits(logits, entries.to(device), presence, frequency, repetition))
        params = _row_params(metadata, num_rows, vocab_size, device)
        out = torch.empty(num_rows, dtype=torch.int64, device=device)
        self._launch(sampling_ops.sample_rows(out, logits, *params))
        token_ids = out.tolist()
        logprobs = [None] * num_rows
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, out, metadata.num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, row_indices: list[int]) -> None:
        """Only the constrained rows' words go to the device: one gather on the host into a
        (pinned, on a GPU) buffer, then one copy for the words and one for the row indices."""
        if not row_indices:
            return
        num_rows = logits.shape[0]
        if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
            raise ValueError(f"bitmask: expected a host int32 [N, words] tensor, got {bitmask.dtype} "
                             f"{tuple(bitmask.shape)} on {bitmask.device}")
        if bitmask.shape[0] != num_rows:
            raise ValueError(f"bitmask: {bitmask.shape[0]} rows, logits have {num_rows}")
        if not 0 <= min(row_indices) <= max(row_indices) < num_rows:  # the kernel writes where they point
            raise ValueError(f"row_indices out of range for {num_rows} rows")
        device = logits.device
        # Pinned host memory makes the copies truly asynchronous; PyTorch's pinned allocator keeps
        # these buffers alive until the copies finish, so they may be dropped right away.
        pinned = device.type == "cuda"
        rows = torch.tensor(row_indices, dtype=torch.int32, pin_memory=pinned)
        words = torch.empty((len(row_indices), bitmask.shape[1]), dtype=torch.int32, pin_memory=pinned)
        torch.index_select(bitmask, 0, rows, out=words)
        self._launch(bitmask_ops.apply_token_bitmask(
            logits, words.to(device, non_blocking=True), rows.to(device, non_blocking=True)))

    def _launch(self, launch) -> None:
        if launch is not None:
            self.launcher(launch)


def _sparse_entries(m: SamplingMetadata) -> sampling_ops.SparseLogitEntries:
    p = m.penalties
    return sampling_ops.merge_entries(
        m.logit_bias, m.banned, (p.rows, p.prompt_token_ids, p.output_token_ids) if p is not None else None)


def _penalty_columns(m: SamplingMetadata, num_rows: int, device) -> tuple[torch.Tensor, ...]:
    if m.penalties is None:  # bias or bans only: neutral factors
        zeros = torch.zeros(num_rows, dtype=torch.float32, device=device)
        return zeros, zeros, torch.ones(num_rows, dtype=torch.float32, device=device)
    p = m.penalties
    return tuple(t.reshape(-1).float().contiguous() for t in (p.presence, p.frequency, p.repetition))


def _row_params(m: SamplingMetadata, num_rows: int, vocab_size: int, device) -> tuple[torch.Tensor, ...]:
    """temperature (0 on greedy rows), top_k, top_p, min_p, seeds, offsets for sample_rows."""
    if m.all_greedy:
        temperature = torch.zeros(num_rows, dtype=torch.float32, device=device)
    else:
        temperature = m.temperature.reshape(-1).float()
        if m.is_greedy is not None:
            temperature = temperature.masked_fill(m.is_greedy, 0.0)
    temperature = temperature.contiguous()
    top_k = (m.top_k.clamp(max=vocab_size).int() if m.top_k is not None
             else torch.zeros(num_rows, dtype=torch.int32, device=device))
    top_p = m.top_p.float() if m.top_p is not None else torch.ones(num_rows, dtype=torch.float32, device=device)
    min_p = m.min_p.float() if m.min_p is not None else torch.zeros(num_rows, dtype=torch.float32, device=device)
    if m.all_greedy:  # no row draws: its key is never read
        keys = torch.zeros((num_rows, 2), dtype=torch.int64, device=device)
    else:  # unseeded rows: fresh keys from the device's default generator, made where they are read
        keys = torch.randint(-(2**63), 2**63 - 1, (num_rows, 2), dtype=torch.int64, device=device)
    if m.generators:  # seeded rows' keys come from the host: one copy of (row, seed, offset) triples
        seeded = torch.tensor([(row, *philox_key(g)) for row, g in m.generators.items()], dtype=torch.int64)
        seeded = seeded.to(device)
        keys[seeded[:, 0]] = seeded[:, 1:]
    return (temperature, top_k.contiguous(), top_p.contiguous(), min_p.contiguous(),
            keys[:, 0].contiguous(), keys[:, 1].contiguous())


def philox_key(generator: torch.Generator) -> tuple[int, int]:
    """(seed, offset) for one step of a seeded request, advancing its generator.

    A CUDA generator is Philox already: its seed and offset are read and the offset moved on, all
    on the host. A CPU generator (the shim tests) gives one 63-bit draw as the step's seed.
    """
    if generator.device.type == "cuda":
        try:
            offset = generator.get_offset()
            generator.set_offset(offset + 4)
            return _signed(generator.initial_seed()), offset
        except (AttributeError, RuntimeError):  # a torch without Philox offsets: one draw (a sync)
            pass
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)), 0


def _signed(x: int) -> int:
    """A 64-bit value as the int64 that carries its bits."""
    return int(np.array(x & (2**64 - 1), dtype=np.uint64).view(np.int64))
