"""One request's grammar matcher, and the step's bitmask over the rows that carry one.

The matcher lives in the worker's request state, so it survives preemption: a request resumed by
recompute continues its grammar. A token sampled by a step in flight when the scheduler preempted
the request is dropped by the scheduler and sampled again; `sync_to` rolls the matcher back to the
tokens the scheduler resent.
"""
from __future__ import annotations

from typing import Any

import torch


class GrammarState:
    def __init__(self, compiled_grammar: Any):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.num_accepted_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Advances the grammar by a sampled token; False if the grammar does not allow it."""
        if self.matcher.is_terminated():
            return True  # past the grammar's end (ignore_eos): nothing left to constrain
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted_tokens += 1
        return True

    def sync_to(self, num_output_tokens: int) -> None:
        """Rolls back tokens the scheduler dropped (it resent only the first `num_output_tokens`)."""
        extra = self.num_accepted_tokens - num_output_tokens
        if extra > 0:
            self.matcher.rollback(extra)
            self.num_accepted_tokens = num_output_tokens

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarBitmask:
    """The step's allowed-token bitmask: one host buffer [max_num_seqs, vocab / 32], made on first use."""

    def __init__(self, max_num_rows: int, vocab_size: int):
        self.max_num_rows = max_num_rows
        self.vocab_size = vocab_size
        self._buffer: torch.Tensor | None = None

    def fill(self, states: list[GrammarState | None]) -> tuple[torch.Tensor, list[int]]:
        """The bitmask for logits rows `states` (row i for states[i]) and the rows it constrains:
        those whose state is set and not past the grammar's end (other rows must not be read)."""
        if self._buffer is None:
            import xgrammar as xgr

            self._buffer = xgr.allocate_token_bitmask(self.max_num_rows, self.vocab_size)
        bitmask = self._buffer[: len(states)]
        rows = []
        for i, state in enumerate(states):
            if state is not None and not state.is_terminated:
                state.matcher.fill_next_token_bitmask(bitmask, i)
                rows.append(i)
        return bitmask, rows
