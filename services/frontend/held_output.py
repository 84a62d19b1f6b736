"""A final-only request's outputs, held by the engine client and merged as they arrive, so a step
costs such a request one list extend instead of a task wake-up."""
from __future__ import annotations

from services.common.messages import EngineCoreOutput, OutputExtras


class HeldOutput:
    """A final-only request's outputs so far, merged as they arrive."""

    __slots__ = ("token_ids", "logprobs", "events", "num_cached_tokens")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.events: list = []
        self.num_cached_tokens = 0

    def add(self, extras: OutputExtras) -> None:
        """A step's extras (its tokens are added to `token_ids` by the caller)."""
        self.logprobs += extras.new_logprobs
        self.events += extras.events
        self.num_cached_tokens = max(self.num_cached_tokens, extras.num_cached_tokens)

    def merged(self, request_id: str, last: OutputExtras) -> EngineCoreOutput:
        """Everything held (`last` included) as one output with `last`'s finish."""
        return EngineCoreOutput(request_id, self.token_ids, self.logprobs, last.finish_reason, last.stop_reason,
                                self.num_cached_tokens, self.events, last.error_message, last.error_code)

