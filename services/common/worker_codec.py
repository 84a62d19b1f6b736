"""Converts the scheduler <-> worker protobuf messages (worker.proto) to the plain dataclasses of
`messages` and back. Sampling params and logprobs are engine_core.proto types, converted by `codec`.

SchedulerOutput and ModelRunnerOutput travel in columns, as `codec` explains. On the step stream a
message also leaves out what the other end can work out, and that is done here only: what the
scheduler and the runner see is always the complete dataclass. Each end of a stream keeps what it
needs (`StepEncoder` at the scheduler, `StepDecoder` at the worker; a new stream, a new pair):

- A step whose requests are all cached, none resumed, exactly the last step's in its batch order,
  and each with `num_computed_tokens` equal to its count in the last step plus the tokens it was
  scheduled then, is sent with `req_ids_as_last_step` and neither ids nor counts; the worker's end
  fills both in. The scheduler counts a step's tokens as computed when it schedules them (async
  scheduling schedules the next step on those counts, before this one's output is back), so a
  steady decode step follows the rule; the scheduler's end checks every count and sends a step
  that does not in full.
- An output whose requests are its step's scheduled ones (those given tokens), in batch order, is
  sent with `req_ids_as_scheduled` and no ids; the scheduler's end keeps the scheduled ids of each
  step in flight, oldest first, as the worker answers steps in the order they were sent.
- A step the worker failed to decode or run leaves nothing to refer to: the worker refuses a step
  sent against it, and the scheduler's end, told so by the failed step's answer, sends its next
  step in full.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import chain
from operator import add

from services.common import messages
from services.common.codec import (
    flat_from_pb,
    ids_or_referred,
    sampling_params_from_pb,
    sampling_params_to_pb,
    one_each_or_counts,
    split_column,
    split_one_each_or_counts,
    structured_outputs_from_pb,
    structured_outputs_to_pb,
    token_logprobs_from_pb,
    token_logprobs_to_pb,
)
from services.common.pb import worker_pb2 as w_pb


class StepFailed(Exception):
    """The worker answered a step with an error (the message says why)."""


@dataclass(frozen=True, slots=True)
class _LastStep:
    """What the step after this one may leave out."""

    order: list[str]  # batch order: new requests, then cached ones
    next_num_computed: list[int]  # per request: num_computed_tokens + num_scheduled_tokens


def _counts(lists: list[list[int]]) -> list[int]:
    """One count per list, or none when every list is empty (the column is then omitted)."""
    counts = list(map(len, lists))
    return counts if any(counts) else []


def _encode_step(step: messages.SchedulerOutput, last: _LastStep | None
                 ) -> tuple[w_pb.SchedulerOutput, _LastStep, list[str]]:
    """The step's message, what the next step may refer to, and the step's scheduled ids."""
    cached = step.scheduled_cached_reqs
    new_reqs = step.scheduled_new_reqs
    order = [r.req_id for r in new_reqs] + cached.req_ids
    counts = step.num_scheduled_tokens
    # The dict's key order is the batch order whenever it holds every request (the scheduler's case).
    in_order = len(counts) == len(order) and list(counts) == order
    num_scheduled = list(counts.values()) if in_order else [counts.get(req_id, 0) for req_id in order]
    one_each = num_scheduled.count(1) == len(num_scheduled)  # a decode step
    is_resumed = cached.resumed_from_preemption
    any_resumed = any(is_resumed)
    resumed = [t for t, r in zip(cached.resumed_token_ids, is_resumed) if r] if any_resumed else []
    as_last_step = last is not None and bool(last.order) and not new_reqs and not any_resumed \
        and cached.req_ids == last.order and cached.num_computed_tokens == last.next_num_computed
    msg = w_pb.SchedulerOutput(
        scheduled_new_reqs=[
            w_pb.NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=sampling_params_to_pb(r.sampling_params),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                traceparent=r.traceparent,
            )
            for r in new_reqs
        ],
        scheduled_cached_reqs=w_pb.CachedRequestData(
            req_ids=[] if as_last_step else cached.req_ids,
            req_ids_as_last_step=as_last_step,
            resumed_from_preemption=is_resumed if any_resumed else [],
            num_computed_tokens=[] if as_last_step else cached.num_computed_tokens,
            new_block_ids=list(chain.from_iterable(cached.new_block_ids)),
            num_new_block_ids=_counts(cached.new_block_ids),
            resumed_token_ids=list(chain.from_iterable(resumed)),
            num_resumed_token_ids=list(map(len, resumed)),
        ),
        num_scheduled_tokens=[] if one_each else num_scheduled,
        total_num_scheduled_tokens=step.total_num_scheduled_tokens,
        finished_req_ids=sorted(step.finished_req_ids),
        preempted_req_ids=sorted(step.preempted_req_ids),
        step_id=step.step_id,
        grammars_to_compile=[structured_outputs_to_pb(p) for p in step.grammars_to_compile.values()],
    )
    num_computed = [r.num_computed_tokens for r in new_reqs] + cached.num_computed_tokens if new_reqs \
        else cached.num_computed_tokens
    # The worker's view of the scheduled ids: the decoded dict, batch order, no zero counts.
    scheduled = order if in_order and (one_each or 0 not in num_scheduled) \
        else [r for r, n in zip(order, num_scheduled) if n]
    return msg, _LastStep(order, list(map(add, num_computed, num_scheduled))), scheduled


def _decode_step(msg: w_pb.SchedulerOutput, last: _LastStep | None) -> tuple[messages.SchedulerOutput, _LastStep]:
    cached = msg.scheduled_cached_reqs
    new_reqs = [
        messages.NewRequestData(
            req_id=r.req_id,
            prompt_token_ids=list(r.prompt_token_ids),
            sampling_params=sampling_params_from_pb(r.sampling_params),
            block_ids=list(r.block_ids),
            num_computed_tokens=r.num_computed_tokens,
            traceparent=r.traceparent,
        )
        for r in msg.scheduled_new_reqs
    ]
    if cached.req_ids_as_last_step:
        if last is None:
            raise ValueError("a step refers to the last step's requests, which this end of the stream does not have")
        req_ids, num_computed = list(last.order), list(last.next_num_computed)
    else:
        req_ids, num_computed = list(cached.req_ids), list(cached.num_computed_tokens)
    num_reqs = len(req_ids)
    is_resumed = list(cached.resumed_from_preemption) or [False] * num_reqs
    if cached.num_new_block_ids:
        new_block_ids = split_column(list(cached.new_block_ids), list(cached.num_new_block_ids))
    else:
        new_block_ids = [[] for _ in range(num_reqs)]
    if not len(num_computed) == len(is_resumed) == len(new_block_ids) == num_reqs \
            or len(cached.num_resumed_token_ids) != (is_resumed.count(True) if cached.resumed_from_preemption else 0):
        raise ValueError(f"a step's columns do not match its {num_reqs} cached requests")
    resumed_token_ids: list[list[int]] = []  # none resumed: no per-request lists at all
    if cached.num_resumed_token_ids:
        resumed_token_ids = [[] for _ in range(num_reqs)]
        tokens = iter(split_column(list(cached.resumed_token_ids), list(cached.num_resumed_token_ids)))
        for i in (i for i, r in enumerate(is_resumed) if r):
            resumed_token_ids[i] = next(tokens)
    order = [r.req_id for r in new_reqs] + req_ids
    num_scheduled = list(msg.num_scheduled_tokens) or [1] * len(order)
    if msg.num_scheduled_tokens and (len(num_scheduled) != len(order) or min(num_scheduled) < 0):
        raise ValueError(f"a step has {len(msg.num_scheduled_tokens)} counts for its {len(order)} requests")
    step = messages.SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=messages.CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=is_resumed,
            new_block_ids=new_block_ids,
            num_computed_tokens=num_computed,
            resumed_token_ids=resumed_token_ids,
        ),
        # Key order is the batch order; requests given no tokens were not in the decision.
        num_scheduled_tokens={r: n for r, n in zip(order, num_scheduled) if n}
        if msg.num_scheduled_tokens else dict.fromkeys(order, 1),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        preempted_req_ids=set(msg.preempted_req_ids),
        step_id=msg.step_id,
        grammars_to_compile={p.key: p for p in map(structured_outputs_from_pb, msg.grammars_to_compile)},
    )
    if new_reqs:
        num_computed = [r.num_computed_tokens for r in new_reqs] + num_computed
    return step, _LastStep(order, list(map(add, num_computed, num_scheduled)))


def scheduler_output_to_pb(step: messages.SchedulerOutput) -> w_pb.SchedulerOutput:
    """A step in full, as the first on a stream is sent."""
    return _encode_step(step, None)[0]


def scheduler_output_from_pb(msg: w_pb.SchedulerOutput) -> messages.SchedulerOutput:
    """A step sent in full."""
    return _decode_step(msg, None)[0]


def model_runner_output_to_pb(output: messages.ModelRunnerOutput, scheduled: list[str] | None = None
                              ) -> w_pb.ModelRunnerOutput:
    """`scheduled`: the step's scheduled request ids in batch order (`num_scheduled_tokens`' keys)."""
    sampled = output.sampled_token_ids
    as_scheduled = bool(scheduled) and output.req_ids == scheduled
    msg = w_pb.ModelRunnerOutput(
        req_ids=[] if as_scheduled else output.req_ids,
        req_ids_as_scheduled=as_scheduled,
        sampled_token_ids=list(chain.from_iterable(sampled)),
        num_sampled_token_ids=one_each_or_counts(sampled),
        prepare_ns=output.prepare_ns,
        forward_ns=output.forward_ns,
        sample_ns=output.sample_ns,
        step_id=output.step_id,
    )
    if output.failed_reqs:
        msg.failed_req_ids.extend(output.failed_reqs)
        msg.failure_messages.extend(output.failed_reqs.values())
    if output.compiled_grammar_keys:
        msg.compiled_grammar_keys.extend(output.compiled_grammar_keys)
    if output.failed_grammars:
        msg.failed_grammar_keys.extend(output.failed_grammars)
        msg.grammar_failure_messages.extend(output.failed_grammars.values())
    logprobs = output.logprobs
    if logprobs.count(None) != len(logprobs):
        indices = [i for i, lp in enumerate(logprobs) if lp is not None]
        msg.logprobs_req_indices.extend(indices)
        msg.logprobs.extend([token_logprobs_to_pb(logprobs[i]) for i in indices])
    return msg


def model_runner_output_from_pb(msg: w_pb.ModelRunnerOutput, scheduled: list[str] | None = None
                                ) -> messages.ModelRunnerOutput:
    """`scheduled`: the step's scheduled request ids in batch order, as the worker decoded them."""
    req_ids = ids_or_referred(msg.req_ids, msg.req_ids_as_scheduled, scheduled, "its step's requests")
    sampled = split_one_each_or_counts(list(msg.sampled_token_ids), list(msg.num_sampled_token_ids))
    indices = list(msg.logprobs_req_indices)
    if len(sampled) != len(req_ids) or len(indices) != len(msg.logprobs) \
            or (indices and not 0 <= min(indices) <= max(indices) < len(req_ids)):
        raise ValueError(f"an output's columns do not match its {len(req_ids)} requests")
    logprobs: list[messages.TokenLogprobs | None] = [None] * len(req_ids)
    for i, lp in zip(indices, msg.logprobs):
        logprobs[i] = token_logprobs_from_pb(lp)
    return messages.ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prepare_ns=msg.prepare_ns,
        forward_ns=msg.forward_ns,
        sample_ns=msg.sample_ns,
        step_id=msg.step_id,
        failed_reqs=dict(zip(msg.failed_req_ids, msg.failure_messages, strict=True)) if msg.failed_req_ids else {},
        compiled_grammar_keys=list(msg.compiled_grammar_keys),
        failed_grammars=dict(zip(msg.failed_grammar_keys, msg.grammar_failure_messages, strict=True))
        if msg.failed_grammar_keys else {},
    )


def kv_cache_spec_to_pb(spec: messages.KVCacheSpec) -> w_pb.DescribeKVCacheResponse:
    return w_pb.DescribeKVCacheResponse(**vars(spec))


def kv_cache_spec_from_pb(msg: w_pb.DescribeKVCacheResponse) -> messages.KVCacheSpec:
    return flat_from_pb(messages.KVCacheSpec, msg)


class StepEncoder:
    """The scheduler's end of one step stream: encodes each step against the one sent before it and
    decodes each answer against the step it answers, the oldest one in flight."""

    def __init__(self) -> None:
        self._last: _LastStep | None = None  # the step sent last, unless an answer said a step failed
        self._in_flight: deque[tuple[int, list[str]]] = deque()  # (step_id, scheduled ids), oldest first

    def encode(self, step: messages.SchedulerOutput) -> w_pb.SchedulerOutput:
        msg, self._last, scheduled = _encode_step(step, self._last)
        self._in_flight.append((step.step_id, scheduled))
        return msg

    def decode_output(self, response: w_pb.ExecuteModelResponse) -> messages.ModelRunnerOutput:
        """The output of the oldest step in flight. Raises StepFailed if the worker failed that step;
        ValueError if the answer is not that step's (the stream is out of step)."""
        out = response.model_runner_output
        if not self._in_flight:
            raise ValueError(f"an answer for step {out.step_id}, but no step is in flight")
        step_id, scheduled = self._in_flight.popleft()
        if out.step_id != step_id:
            raise ValueError(f"an answer for step {out.step_id} where step {step_id} was due")
        if response.error_message:
            self._last = None  # the worker kept nothing of the failed step: the next step goes in full
            raise StepFailed(response.error_message)
        return model_runner_output_from_pb(out, scheduled)


def decode_acknowledgement(response: w_pb.ExecuteModelResponse, step_id: int) -> messages.ModelRunnerOutput:
    """A tensor-parallel rank's answer to step `step_id` (only rank 0 returns tokens): an empty output.
    Raises StepFailed if the rank failed the step; ValueError if the answer is another step's."""
    out = response.model_runner_output
    if out.step_id != step_id:
        raise ValueError(f"an answer for step {out.step_id} where step {step_id} was due")
    if response.error_message:
        raise StepFailed(response.error_message)
    return messages.ModelRunnerOutput(step_id=step_id)


class StepDecoder:
    """The worker's end of one step stream: decodes each step against the last one that ran, and
    encodes each step's answer. Every step decoded must be answered before the next is decoded."""

    def __init__(self) -> None:
        self._last: _LastStep | None = None  # the last step answered with an output
        self._current: tuple[_LastStep, list[str]] | None = None  # decoded, not answered; scheduled ids

    def decode(self, msg: w_pb.SchedulerOutput) -> messages.SchedulerOutput:
        last, self._last = self._last, None  # until this step has run, the next may not refer to it
        step, decoded = _decode_step(msg, last)
        self._current = (decoded, list(step.num_scheduled_tokens))
        return step

    def encode_output(self, output: messages.ModelRunnerOutput) -> w_pb.ExecuteModelResponse:
        """The answer of the step decoded last, which ran: the next step may refer to it."""
        if self._current is None:
            raise RuntimeError("no step decoded to answer")
        (self._last, scheduled), self._current = self._current, None
        return w_pb.ExecuteModelResponse(model_runner_output=model_runner_output_to_pb(output, scheduled))

    def encode_failure(self, step_id: int, message: str) -> w_pb.ExecuteModelResponse:
        """The answer of a step that failed to decode or to run: the next step may not refer to it."""
        self._current = None
        return w_pb.ExecuteModelResponse(model_runner_output=w_pb.ModelRunnerOutput(step_id=step_id),
                                         error_message=message)
