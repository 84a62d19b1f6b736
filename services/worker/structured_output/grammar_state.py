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


def fill_bitmask(states: list[GrammarState | None], bitmask: torch.Tensor) -> list[int]:
    """Fills row i of `bitmask` for each row whose state is set and still constrains; returns those
    rows (the others' bitmask rows are left as they are and must not be read)."""
    rows = []
    for i, state in enumerate(states):
        if state is not None and not state.is_terminated:
            state.matcher.fill_next_token_bitmask(bitmask, i)
            rows.append(i)
    return rows
