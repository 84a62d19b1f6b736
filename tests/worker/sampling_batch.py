"""Sampling metadata for requests given as lists, built the way the runner builds it: through a
persistent batch whose rows hold the requests' knobs and tokens."""
from __future__ import annotations

import numpy as np
import torch

from services.common.messages import SamplingParams
from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.sampling_metadata import SamplingMetadata, build_sampling_metadata


def batch_of(params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
             prompt_token_ids: list[list[int]] | None = None, output_token_ids: list[list[int]] | None = None,
             max_num_reqs: int | None = None) -> InputBatch:
    """A batch with request `r{i}` in row i, holding `params[i]`, its generator and tokens."""
    n = len(params)
    generators = generators or [None] * n
    prompts = prompt_token_ids or [[] for _ in params]
    outputs = output_token_ids or [[] for _ in params]
    max_len = max([len(p) + len(o) for p, o in zip(prompts, outputs)] + [1])
    batch = InputBatch(max_num_reqs=max_num_reqs or max(n, 1), max_model_len=max_len, block_size=16)
    for i, p in enumerate(params):
        batch.add_request(CachedRequestState(f"r{i}", list(prompts[i]), p, generators[i], [], 0, list(outputs[i])))
    return batch


def metadata_for(params: list[SamplingParams], generators: list[torch.Generator | None],
                 prompt_token_ids: list[list[int]], output_token_ids: list[list[int]], eos_token_ids: tuple[int, ...],
                 vocab_size: int, device: torch.device = torch.device("cpu")) -> SamplingMetadata:
    """Logits row i samples for `params[i]` with `generators[i]` and its tokens so far."""
    batch = batch_of(params, generators, prompt_token_ids, output_token_ids)
    return build_sampling_metadata(batch, np.arange(len(params)), eos_token_ids, vocab_size, device)
