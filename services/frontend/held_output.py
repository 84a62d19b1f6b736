"""A request's outputs held by the engine client between handovers, merged as they arrive.

A final-only request (non-streamed, no stop strings) is handed its outputs once, when it finishes;
a streamed one with a stream interval above one every that many tokens (its first token and its
finish at once). Each step a held request costs one list extend instead of a task wake-up, a
detokenizer call, a response chunk and a socket write.
"""
from __future__ import annotations

from services.common.messages import EngineCoreOutput, OutputExtras

# HeldOutput's interval for a final-only request: hand over only when it finishes.
UNTIL_FINISHED = 0


class HeldOutput:
    """A held request's outputs since its last handover."""

    __slots__ = ("interval", "has_handed_over", "token_ids", "logprobs", "events", "num_cached_tokens")

    def __init__(self, interval: int = UNTIL_FINISHED) -> None:
        self.interval = interval
        self.has_handed_over = False
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.events: list = []
        self.num_cached_tokens = 0

    def add(self, token_ids: list[int], extras: OutputExtras | None) -> None:
        """One step's output."""
        self.token_ids += token_ids
        if extras is not None:
            self.logprobs += extras.new_logprobs
            self.events += extras.events
            self.num_cached_tokens = max(self.num_cached_tokens, extras.num_cached_tokens)

    def is_due(self, last: OutputExtras | None) -> bool:
        """Whether to hand over now: the request finished, or a streamed one has its first token or
        `interval` tokens held."""
        if last is not None and last.finished:
            return True
        if self.interval == UNTIL_FINISHED or not self.token_ids:
            return False
        return not self.has_handed_over or len(self.token_ids) >= self.interval

    def take(self, request_id: str, last: OutputExtras | None) -> EngineCoreOutput:
        """Everything held as one output with `last`'s finish (none: not finished); holds nothing after."""
        if last is None:
            output = EngineCoreOutput(request_id, self.token_ids, self.logprobs,
                                      num_cached_tokens=self.num_cached_tokens, events=self.events)
        else:
            output = EngineCoreOutput(request_id, self.token_ids, self.logprobs, last.finish_reason, last.stop_reason,
                                      self.num_cached_tokens, self.events, last.error_message, last.error_code)
        self.token_ids, self.logprobs, self.events = [], [], []
        self.has_handed_over = True
        return output
