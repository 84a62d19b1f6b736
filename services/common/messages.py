"""Plain dataclasses for the messages between services.

The codec modules convert these to and from protobuf; everything else (scheduler, model runner,
frontend logic) works on these types only, so it can be unit-tested without gRPC.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.structured_outputs import StructuredOutputsParams


class FinishReason(enum.IntEnum):
    """Why a request finished; NONE while it is still running (values match the proto enum)."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4

    def to_openai(self) -> str | None:
        return _OPENAI_FINISH_REASONS[self]


_OPENAI_FINISH_REASONS = {
    FinishReason.NONE: None,
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class RequestEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM's names; stop strings stay in the frontend)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output constraint; None is free text. Logprobs are then the constrained distribution's
    # (the model's, renormalised over the tokens the grammar allows), the one the token is drawn from.
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str = ""
    traceparent: str = ""
    tracestate: str = ""


@dataclass(slots=True)
class RequestEvent:
    type: RequestEventType
    timestamp: float


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob and rank of one sampled token, plus the top alternatives as (token_id, logprob)."""

    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class OutputExtras:
    """What a request's step output carries besides its new tokens; most outputs have none."""

    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    events: list[RequestEvent] = field(default_factory=list)
    error_message: str = ""
    # "invalid_argument", "resource_exhausted", "unavailable" or "internal" when finish_reason is ERROR;
    # "draining": refused by a draining engine before it started (the frontend sends it elsewhere).
    error_code: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's output of one step, as the frontend's engine client hands it to that request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    events: list[RequestEvent] = field(default_factory=list)
    error_message: str = ""
    error_code: str = ""

    @classmethod
    def of(cls, request_id: str, new_token_ids: list[int], extras: OutputExtras | None) -> EngineCoreOutput:
        if extras is None:
            return cls(request_id, new_token_ids)
        return cls(request_id, new_token_ids, extras.new_logprobs, extras.finish_reason, extras.stop_reason,
                   extras.num_cached_tokens, extras.events, extras.error_message, extras.error_code)

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_steps: int = 0


@dataclass
class EngineCoreOutputs:
    """One engine step's outputs (for one frontend, once routed), in one shape from the scheduler
    to the frontend's dispatch: a column of request ids and one of their new tokens (a request at
    most once), and, for the few outputs that carry more (a finish, events, logprobs, an error),
    `OutputExtras` keyed by request id. A request's first output always has events (QUEUED,
    SCHEDULED), so it carries `num_cached_tokens` and later outputs need not.
    """

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    extras: dict[str, OutputExtras] = field(default_factory=dict)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0

    def append(self, req_id: str, new_token_ids: list[int], extras: OutputExtras | None = None) -> None:
        self.req_ids.append(req_id)
        self.new_token_ids.append(new_token_ids)
        if extras is not None:
            self.extras[req_id] = extras


@dataclass
class NewRequestData:
    """A request sent to the worker in full: first scheduling, or resumption after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    traceparent: str = ""  # the request's scheduler span, so the worker's span can be its child


@dataclass
class CachedRequestData:
    """Requests the worker already holds, in columns: each one's blocks added since the last step
    and its count (tokens only for resumed ones: the worker appends what it samples)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Tokens whose KV is in the cache before this step.
    num_computed_tokens: list[int] = field(default_factory=list)
    # Full token ids for resumed requests (empty list otherwise); the scheduler sends a list for the
    # resumed requests only, which come first, and leaves the running ones' out.
    resumed_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One engine step, as a diff against the previous one.

    `num_scheduled_tokens` is the decision; its key order is the batch order.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    step_id: int = 0
    # Grammars the worker compiles ahead of their requests, keyed by StructuredOutputsParams.key.
    grammars_to_compile: dict[str, StructuredOutputsParams] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """What the worker computed for one step.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is empty for a partial prefill chunk.
    `logprobs[i]` is None unless the request asked for logprobs. `failed_reqs` maps the requests the
    worker refused to run this step (bad inputs it could tie to them) to the reason; they are not in
    `req_ids`, and the step's other requests ran.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    step_id: int = 0
    failed_reqs: dict[str, str] = field(default_factory=dict)
    # Grammar compiles finished since the last step: keys compiled, and keys that failed -> why.
    compiled_grammar_keys: list[str] = field(default_factory=list)
    failed_grammars: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class KVCacheSpec:
    """What the worker found at start-up: reported to the scheduler, never guessed by it."""

    block_size: int
    num_blocks: int
    block_bytes: int
    max_model_len: int
    model_name: str
    device: str
    dtype: str
    vocab_size: int
    attention_backend: str  # AttentionBackend.name, or "none" for the fake model
    # Tensor parallelism (services/worker/parallel/): this rank of how many, every rank's shard layout
    # (equal on all ranks of one engine), and where rank 0's rendezvous store listens.
    tensor_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    shard_layout: str = ""
    tensor_parallel_port: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """What the scheduler tells a frontend about the engine behind it."""

    model_name: str
    max_model_len: int
    block_size: int
    num_blocks: int
    device: str
    dtype: str
    vocab_size: int
    attention_backend: str
    max_num_seqs: int = 0  # the scheduler's running window; 0 when unknown
