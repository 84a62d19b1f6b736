"""A model runner without a model, for measuring the engine's own cost (`--fake-model`).

It keeps the same per-request bookkeeping as `ModelRunner` (the scheduler's diffs are applied in
full, so protocol mistakes still raise, and a new request with token ids outside the vocabulary
fails alone, in `failed_reqs`), but its "forward" is free: every request whose computed
tokens reach the end of its known tokens this step (computed + scheduled == known, the rule the real
runner samples by) gets `FAKE_TOKEN_ID` at once. Nothing is allocated: the KV cache is only
reported, sized for the embedded SmolLM2-135M-Instruct's geometry so the scheduler sees the block
count a real worker with the same `--kv-cache-bytes` would report (a large budget costs no memory).

Output constraints are not applied (the token is fixed): every grammar the scheduler announces is
reported compiled in the same step, so constrained requests run as the others do.

What remains per step is exactly the service split's overhead: scheduling, protobuf encoding and
decoding, and the gRPC round trips between frontend, scheduler and worker.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.common.messages import KVCacheSpec, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from services.common.model_files import DEFAULT_MODEL_NAME
from services.worker.config import WorkerConfig
from services.worker.input_checks import RequestInputError, check_token_ids
from services.worker.kv_cache import KVCacheLayout, num_blocks_for_budget

# SmolLM2-135M-Instruct's shape: the frontend serves its tokenizer, so ids must fit its vocabulary.
FAKE_VOCAB_SIZE = 49152
FAKE_NUM_LAYERS = 30
FAKE_NUM_KV_HEADS = 3
FAKE_HEAD_DIM = 64
FAKE_MAX_MODEL_LEN = 8192  # the model's max_position_embeddings; --max-model-len overrides it
FAKE_TOKEN_ID = 260  # " the": never an EOS id, so requests end by max_tokens


@dataclass(slots=True)  # touched per request per step
class _FakeRequestState:
    num_tokens: int  # prompt + sampled tokens the worker knows
    num_computed_tokens: int
    wants_logprobs: bool


class FakeModelRunner:
    """The `ModelRunner` interface (initialize_kv_cache, reset, execute_model) with no model."""

    def __init__(self, kv_cache_layout: KVCacheLayout, token_id: int = FAKE_TOKEN_ID,
                 vocab_size: int = FAKE_VOCAB_SIZE, fault_token_id: int = -1):
        self.kv_cache_layout = kv_cache_layout
        self.token_id = token_id
        self.vocab_size = vocab_size
        # A prompt holding it faults the "device" for good: every step from then on raises.
        self.fault_token_id = fault_token_id
        self.is_faulted = False
        self.requests: dict[str, _FakeRequestState] = {}
        self.failed_req_ids: set[str] = set()  # as ModelRunner's: skipped until reported finished

    def initialize_kv_cache(self, num_blocks: int) -> int:
        """Drops all request state; allocates nothing and returns the bytes a real cache would take."""
        self.reset()
        return num_blocks * self.kv_cache_layout.bytes_per_block

    def reset(self) -> None:
        self.requests.clear()
        self.failed_req_ids.clear()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter_ns()
        if self.fault_token_id >= 0 and not self.is_faulted:
            self.is_faulted = any(self.fault_token_id in new.prompt_token_ids
                                  for new in scheduler_output.scheduled_new_reqs)
        if self.is_faulted:
            raise RuntimeError("injected device fault (--fake-model-fault-token-id): every step fails")
        failed: dict[str, str] = {}
        self._update_states(scheduler_output, failed)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        logprobs: list[TokenLogprobs | None] = []
        skipped = self.failed_req_ids
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            if num_scheduled <= 0 or (skipped and req_id in skipped):
                continue
            state = self.requests.get(req_id)
            if state is None:
                raise ValueError(f"request {req_id!r} scheduled but unknown to this worker")
            state.num_computed_tokens += num_scheduled
            if state.num_computed_tokens > state.num_tokens:
                raise ValueError(
                    f"request {req_id!r}: {state.num_computed_tokens} computed tokens exceed the "
                    f"{state.num_tokens} tokens the worker knows"
                )
            req_ids.append(req_id)
            if state.num_computed_tokens == state.num_tokens:
                state.num_tokens += 1
                sampled.append([self.token_id])
                logprobs.append(TokenLogprobs(logprob=0.0, rank=1) if state.wants_logprobs else None)
            else:  # a partial prefill chunk samples nothing
                sampled.append([])
                logprobs.append(None)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prepare_ns=time.perf_counter_ns() - start, step_id=scheduler_output.step_id,
                                 failed_reqs=failed, compiled_grammar_keys=list(scheduler_output.grammars_to_compile))

    def _update_states(self, scheduler_output: SchedulerOutput, failed: dict[str, str]) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        if self.failed_req_ids:
            self.failed_req_ids.difference_update(scheduler_output.finished_req_ids)
        # Preempted requests keep their state: they come back as resumed cached requests.
        for new in scheduler_output.scheduled_new_reqs:
            try:
                check_token_ids(new.prompt_token_ids, "prompt_token_ids", self.vocab_size)
            except RequestInputError as exc:
                self.failed_req_ids.add(new.req_id)
                failed[new.req_id] = str(exc)
                continue
            self.requests[new.req_id] = _FakeRequestState(
                len(new.prompt_token_ids), new.num_computed_tokens, new.sampling_params.logprobs is not None)
        cached = scheduler_output.scheduled_cached_reqs
        requests = self.requests
        try:
            for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
                requests[req_id].num_computed_tokens = num_computed
        except KeyError as exc:
            if exc.args[0] not in self.failed_req_ids:
                raise ValueError(f"scheduler sent cached request {exc.args[0]!r} that this worker does not hold") \
                    from None
            self._update_cached_skipping_failed(cached.req_ids, cached.num_computed_tokens)
        # Resumed requests come first (the scheduler sends a token list for those only).
        for req_id, tokens in zip(cached.req_ids, cached.resumed_token_ids):
            if tokens:  # resumed after preemption: the resent tokens are the truth
                requests[req_id].num_tokens = len(tokens)

    def _update_cached_skipping_failed(self, req_ids: list[str], num_computed_tokens: list[int]) -> None:
        """The slow path of a step that still names a request failed earlier."""
        for req_id, num_computed in zip(req_ids, num_computed_tokens, strict=True):
            state = self.requests.get(req_id)
            if state is not None:
                state.num_computed_tokens = num_computed
            elif req_id not in self.failed_req_ids:
                raise ValueError(f"scheduler sent cached request {req_id!r} that this worker does not hold")


def load_fake_model(config: WorkerConfig, dtype: torch.dtype) -> tuple[FakeModelRunner, KVCacheSpec]:
    """The runner and the KV cache spec a worker reports in `--fake-model` mode."""
    layout = KVCacheLayout(FAKE_NUM_LAYERS, FAKE_NUM_KV_HEADS, FAKE_HEAD_DIM, config.block_size, dtype)
    max_model_len = config.max_model_len or FAKE_MAX_MODEL_LEN
    num_blocks = num_blocks_for_budget(layout, config.kv_cache_bytes, max_model_len, config.max_num_seqs)
    spec = KVCacheSpec(
        block_size=config.block_size,
        num_blocks=num_blocks,
        block_bytes=layout.bytes_per_block,
        max_model_len=max_model_len,
        model_name=config.served_model_name or DEFAULT_MODEL_NAME,
        device="cpu",
        dtype=str(dtype).removeprefix("torch."),
        vocab_size=FAKE_VOCAB_SIZE,
        attention_backend="none",
    )
    return FakeModelRunner(layout, fault_token_id=config.fake_fault_token_id), spec
