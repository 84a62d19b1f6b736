"""The scheduler's view of one request: token counts and status, never tensors."""
from __future__ import annotations

import enum
import time

from services.common.messages import (
    EngineCoreRequest,
    FinishReason,
    RequestEvent,
    RequestEventType,
    SamplingParams,
)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_GRAMMAR = 4  # its output constraint is compiling on the worker (grammar_gate.py)


class Request:
    """A request's progress: `num_computed_tokens` catches up with `num_tokens` step by step."""

    # Every step reads a few fields of every running request: slots keep them in one small object.
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "priority", "cache_salt", "traceparent", "status", "all_token_ids", "num_prompt_tokens",
        "num_computed_tokens", "num_output_placeholders", "num_cached_tokens", "num_preemptions",
        "finish_reason", "stop_reason", "events", "block_hashes", "stop_check_token_ids", "max_num_tokens",
    )

    def __init__(self, req: EngineCoreRequest):
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.sampling_params: SamplingParams = req.sampling_params
        self.eos_token_ids = frozenset(req.eos_token_ids)
        self.arrival_time = req.arrival_time or time.time()
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.traceparent = req.traceparent

        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens the worker samples in steps whose outputs have not come back yet (async scheduling):
        # the next step already computes them, as the worker appends what it samples.
        self.num_output_placeholders = 0
        # Prompt tokens served from the prefix cache at first scheduling (-1 until then).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.finish_reason = FinishReason.NONE
        self.stop_reason: int | None = None
        # Events not yet sent to the frontend.
        self.events: list[RequestEvent] = []
        self.record_event(RequestEventType.QUEUED)
        # Hashes of this request's full blocks, filled by the KV cache manager.
        self.block_hashes: list[int] = []
        # Set by `stop_checker.init_stop_triggers` when the scheduler accepts the request.
        self.stop_check_token_ids: frozenset[int] = frozenset()
        self.max_num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def record_event(self, event_type: RequestEventType) -> None:
        self.events.append(RequestEvent(event_type, time.time()))

    def take_events(self) -> list[RequestEvent]:
        events, self.events = self.events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
