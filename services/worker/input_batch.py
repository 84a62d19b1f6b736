"""The persistent batch: per-request rows that live across steps.

A request gets a row when the scheduler first sends it (or resumes it) and keeps it until it
finishes or is preempted; each step only applies the scheduler's diff. Rows stay dense: removing
a request leaves a hole that `condense` fills with the last rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.messages import SamplingParams
from services.worker.block_table import BlockTable


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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.requests: list[CachedRequestState | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size)
        self._num_rows = 0  # rows [0, _num_rows) are in use, possibly with holes until condense()

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

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
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Frees the request's row (a hole until `condense`); returns it, or None if absent."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.requests[row] = None
        self.block_table.clear_row(row)
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
        req_id = self.req_ids[src]
        num_tokens = int(self.num_tokens[src])
        self.req_ids[dst], self.requests[dst] = req_id, self.requests[src]
        self.req_ids[src] = self.requests[src] = None
        self.req_id_to_index[req_id] = dst
        self.token_ids_cpu[dst, :num_tokens] = self.token_ids_cpu[src, :num_tokens]
        self.num_tokens[dst] = num_tokens
        self.num_computed_tokens_cpu[dst] = self.num_computed_tokens_cpu[src]
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
