"""The persistent batch: per-request rows that live across steps.

A request gets a row when the scheduler first sends it (or resumes it) and keeps it until it
finishes or is preempted; each step only applies the scheduler's diff. Rows stay dense: removing
a request leaves a hole that `condense` fills with the last rows.

Sampling knobs live here too, as vLLM's `InputBatch` keeps them: per-row arrays filled once in
`add_request` and moved with their row, so a step's `SamplingMetadata` is an index into them
(sampling_metadata.py), never a walk over the requests' `SamplingParams`. Per knob the batch counts
the rows that use it, so a batch in which no row uses any knob (all greedy, no logits processors,
no logprobs) samples without looking at the arrays at all. The rows' tokens (`token_ids_cpu`,
prompt then output, appended as tokens are sampled) are the history penalties and min_tokens read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

from services.common.messages import SamplingParams
from services.worker.block_table import BlockTable
from services.worker.structured_output.grammar_state import GrammarState


@dataclass
class CachedRequestState:
    """What the worker knows of one request; kept while it is preempted, dropped when it finishes."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens this worker sampled (or the scheduler resent on resumption), after the prompt.
    output_token_ids: list[int] = field(default_factory=list)
    # The request's output constraint, advanced by every token it samples; None when unconstrained.
    grammar: GrammarState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class Knob(IntEnum):
    """Row flags of `InputBatch.knob_flags_cpu`, one per knob that needs work when a row uses it."""

    RANDOM = 0  # not greedy: temperature, and a draw
    SEEDED = 1  # random with its own generator
    TOP_K = 2  # random with top_k > 0 (the sampler also ignores a top_k of the vocabulary or more)
    TOP_P = 3  # random with top_p < 1
    MIN_P = 4  # random with min_p > 0
    PENALTIES = 5  # presence, frequency or repetition penalty (greedy rows too)
    LOGIT_BIAS = 6
    MIN_TOKENS = 7  # stop tokens banned until min_tokens outputs
    LOGPROBS = 8
    GRAMMAR = 9  # an output constraint: its grammar masks the logits (the runner does it, not the sampler)


# Rows of `InputBatch.float_knobs_cpu`: one gather of its columns gives a step all its float knobs.
FLOAT_KNOBS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(len(FLOAT_KNOBS))


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.requests: list[CachedRequestState | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size)
        self._num_rows = 0  # rows [0, _num_rows) are in use, possibly with holes until condense()
        # Sampling knobs, knob-major so that a gather of the step's rows is contiguous per knob.
        self.float_knobs_cpu = np.zeros((len(FLOAT_KNOBS), max_num_reqs), dtype=np.float32)
        # 1.0 on greedy rows: what the sampler divides their logits by (their draw is discarded).
        self.temperature_cpu = self.float_knobs_cpu[TEMPERATURE]
        self.top_p_cpu = self.float_knobs_cpu[TOP_P]
        self.min_p_cpu = self.float_knobs_cpu[MIN_P]
        self.presence_penalty_cpu = self.float_knobs_cpu[PRESENCE]
        self.frequency_penalty_cpu = self.float_knobs_cpu[FREQUENCY]
        self.repetition_penalty_cpu = self.float_knobs_cpu[REPETITION]
        self.top_k_cpu = np.zeros(max_num_reqs, dtype=np.int64)  # as requested; <= 0 is off
        self.min_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs_cpu = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: not requested
        self.knob_flags_cpu = np.zeros((len(Knob), max_num_reqs), dtype=bool)
        self.num_rows_using = np.zeros(len(Knob), dtype=np.int64)  # live rows with each flag set
        self.generators: dict[int, torch.Generator] = {}  # row -> generator of a seeded request
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (token ids, biases)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def num_grammar_rows(self) -> int:
        return int(self.num_rows_using[Knob.GRAMMAR])

    def add_request(self, state: CachedRequestState) -> int:
        """Gives `state` a row (replacing an existing row of the same id) and returns it."""
        row = self.req_id_to_index.get(state.req_id)
        if row is None:
            if self._num_rows >= self.max_num_reqs:
                self.condense()
            if self._num_rows >= self.max_num_reqs:
                raise ValueError(f"more than max_num_seqs={self.max_num_reqs} requests in the batch")
            row = self._num_rows
            self._num_rows += 1
        num_tokens = state.num_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {state.req_id} has {num_tokens} tokens > max_model_len {self.max_model_len}")
        self.req_ids[row] = state.req_id
        self.requests[row] = state
        self.req_id_to_index[state.req_id] = row
        self.token_ids_cpu[row, : len(state.prompt_token_ids)] = state.prompt_token_ids
        self.token_ids_cpu[row, len(state.prompt_token_ids) : num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        self._set_sampling_row(row, state.sampling_params, state.generator)
        return row

    def _set_sampling_row(self, row: int, p: SamplingParams, generator: torch.Generator | None) -> None:
        self._clear_sampling_row(row)  # a resumed request replaces its own row
        is_random = not p.is_greedy
        self.float_knobs_cpu[:, row] = (p.temperature if is_random else 1.0, p.top_p, p.min_p,
                                        p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        self.top_k_cpu[row] = p.top_k
        self.min_tokens_cpu[row] = p.min_tokens
        self.num_logprobs_cpu[row] = -1 if p.logprobs is None else p.logprobs
        flags = self.knob_flags_cpu[:, row]
        flags[Knob.RANDOM] = is_random
        flags[Knob.SEEDED] = is_random and generator is not None
        flags[Knob.TOP_K] = is_random and p.top_k > 0
        flags[Knob.TOP_P] = is_random and p.top_p < 1.0
        flags[Knob.MIN_P] = is_random and p.min_p > 0.0
        flags[Knob.PENALTIES] = bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
        flags[Knob.LOGIT_BIAS] = bool(p.logit_bias)
        flags[Knob.MIN_TOKENS] = p.min_tokens > 0
        flags[Knob.LOGPROBS] = p.logprobs is not None
        flags[Knob.GRAMMAR] = p.structured_outputs is not None
        self.num_rows_using += flags
        if generator is not None:
            self.generators[row] = generator
        if p.logit_bias:
            self.logit_bias[row] = (np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
                                    np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))

    def _clear_sampling_row(self, row: int) -> None:
        self.num_rows_using -= self.knob_flags_cpu[:, row]
        self.knob_flags_cpu[:, row] = False
        self.generators.pop(row, None)
        self.logit_bias.pop(row, None)

    def remove_request(self, req_id: str) -> int | None:
        """Frees the request's row (a hole until `condense`); returns it, or None if absent."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.requests[row] = None
        self.block_table.clear_row(row)
        self._clear_sampling_row(row)
        return row

    def condense(self) -> None:
        """Moves the last rows into holes so rows [0, num_reqs) are exactly the live requests."""
        dst = 0
        for src in range(self._num_rows):
            req_id = self.req_ids[src]
            if req_id is None:
                continue
            if src != dst:
                self._move_row(src, dst)
            dst += 1
        self._num_rows = dst

    def _move_row(self, src: int, dst: int) -> None:
        """Moves every per-row array and map entry of row `src` into the hole at row `dst`."""
        req_id = self.req_ids[src]
        num_tokens = int(self.num_tokens[src])
        self.req_ids[dst], self.requests[dst] = req_id, self.requests[src]
        self.req_ids[src] = self.requests[src] = None
        self.req_id_to_index[req_id] = dst
        self.token_ids_cpu[dst, :num_tokens] = self.token_ids_cpu[src, :num_tokens]
        for per_row in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu, self.top_k_cpu,
                        self.min_tokens_cpu, self.num_logprobs_cpu):
            per_row[dst] = per_row[src]
        for per_row in (self.float_knobs_cpu, self.knob_flags_cpu):
            per_row[:, dst] = per_row[:, src]
        self.knob_flags_cpu[:, src] = False  # counts unchanged: the row moved, it did not leave
        for by_row in (self.generators, self.logit_bias):
            if src in by_row:
                by_row[dst] = by_row.pop(src)
        self.block_table.move_row(src, dst)
        self.block_table.clear_row(src)

    def append_token(self, row: int, token_id: int) -> None:
        """Records a sampled token at the end of the row's tokens (and in its request state)."""
        state = self.requests[row]
        state.output_token_ids.append(token_id)
        num_tokens = int(self.num_tokens[row])
        if num_tokens < self.max_model_len:  # a token past the limit is never fed back as input
            self.token_ids_cpu[row, num_tokens] = token_id
        self.num_tokens[row] = num_tokens + 1

    def set_num_computed_tokens(self, row: int, num_computed_tokens: int) -> None:
        self.requests[row].num_computed_tokens = num_computed_tokens
        self.num_computed_tokens_cpu[row] = num_computed_tokens

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        self.requests[row].block_ids.extend(block_ids)
        self.block_table.append_row(block_ids, row)

    def clear(self) -> None:
        for req_id in list(self.req_id_to_index):
            self.remove_request(req_id)
        self._num_rows = 0
