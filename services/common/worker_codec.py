"""Converts the scheduler <-> worker protobuf messages (worker.proto) to the plain dataclasses of
`messages` and back. Sampling params and logprobs are engine_core.proto types, converted by `codec`.

SchedulerOutput and ModelRunnerOutput travel in columns, as `codec` explains. In the steady decode
step neither carries request ids: a step whose requests are the last step's, in the same order,
says so with one flag (each end of the stream keeps the last step's order, `step_order`), and an
output for exactly the step's scheduled requests says so with another.
"""
from __future__ import annotations

from itertools import chain

from services.common import messages as m
from services.common.codec import (
    flat_from_pb,
    ids_or_referred,
    sampling_params_from_pb,
    sampling_params_to_pb,
    one_each_or_counts,
    split_column,
    split_one_each_or_counts,
    token_logprobs_from_pb,
    token_logprobs_to_pb,
)
from services.common.pb import worker_pb2 as w_pb


def _counts(lists: list[list[int]]) -> list[int]:
    """One count per list, or none when every list is empty (the column is then omitted)."""
    counts = list(map(len, lists))
    return counts if any(counts) else []


def step_order(s: m.SchedulerOutput) -> list[str]:
    """The step's batch order, as the scheduler built it: new requests, then cached ones."""
    return [r.req_id for r in s.scheduled_new_reqs] + s.scheduled_cached_reqs.req_ids


def scheduler_output_to_pb(s: m.SchedulerOutput, last_order: list[str] | None = None) -> w_pb.SchedulerOutput:
    """`last_order`: the `step_order` of the step sent before this one on the same stream, if any."""
    c = s.scheduled_cached_reqs
    new_reqs = s.scheduled_new_reqs
    order = step_order(s)
    counts = s.num_scheduled_tokens
    # The dict's key order is the batch order whenever it holds every request (the scheduler's case).
    num_scheduled = list(counts.values()) if len(counts) == len(order) and list(counts) == order \
        else [counts.get(req_id, 0) for req_id in order]
    is_resumed = c.resumed_from_preemption
    any_resumed = any(is_resumed)
    resumed = [t for t, r in zip(c.resumed_token_ids, is_resumed) if r] if any_resumed else []
    as_last_step = bool(last_order) and not new_reqs and not any_resumed and c.req_ids == last_order
    return w_pb.SchedulerOutput(
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
            req_ids=[] if as_last_step else c.req_ids,
            req_ids_as_last_step=as_last_step,
            resumed_from_preemption=is_resumed if any_resumed else [],
            num_computed_tokens=[] if as_last_step else c.num_computed_tokens,
            new_block_ids=list(chain.from_iterable(c.new_block_ids)),
            num_new_block_ids=_counts(c.new_block_ids),
            resumed_token_ids=list(chain.from_iterable(resumed)),
            num_resumed_token_ids=list(map(len, resumed)),
        ),
        num_scheduled_tokens=[] if num_scheduled.count(1) == len(num_scheduled) else num_scheduled,
        total_num_scheduled_tokens=s.total_num_scheduled_tokens,
        finished_req_ids=sorted(s.finished_req_ids),
        preempted_req_ids=sorted(s.preempted_req_ids),
        step_id=s.step_id,
    )


def scheduler_output_from_pb(msg: w_pb.SchedulerOutput, last_order: list[str] | None = None) -> m.SchedulerOutput:
    """`last_order`: the `step_order` of the step received before this one on the same stream.

    A step sent as "the last step's requests" decodes with empty `num_computed_tokens`: the worker's
    own counts stand.
    """
    c = msg.scheduled_cached_reqs
    new_reqs = [
        m.NewRequestData(
            req_id=r.req_id,
            prompt_token_ids=list(r.prompt_token_ids),
            sampling_params=sampling_params_from_pb(r.sampling_params),
            block_ids=list(r.block_ids),
            num_computed_tokens=r.num_computed_tokens,
            traceparent=r.traceparent,
        )
        for r in msg.scheduled_new_reqs
    ]
    req_ids = ids_or_referred(c.req_ids, c.req_ids_as_last_step, last_order, "the last step's requests")
    num_reqs = len(req_ids)
    is_resumed = list(c.resumed_from_preemption) or [False] * num_reqs
    if c.num_new_block_ids:
        new_block_ids = split_column(list(c.new_block_ids), list(c.num_new_block_ids))
    else:
        new_block_ids = [[] for _ in range(num_reqs)]
    resumed_token_ids: list[list[int]] = []  # none resumed: no per-request lists at all
    if c.num_resumed_token_ids:
        resumed_token_ids = [[] for _ in range(num_reqs)]
        tokens = iter(split_column(list(c.resumed_token_ids), list(c.num_resumed_token_ids)))
        for i in (i for i, r in enumerate(is_resumed) if r):
            resumed_token_ids[i] = next(tokens)
    order = [r.req_id for r in new_reqs] + req_ids
    return m.SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=m.CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=is_resumed,
            new_block_ids=new_block_ids,
            num_computed_tokens=list(c.num_computed_tokens),
            resumed_token_ids=resumed_token_ids,
        ),
        # Key order is the batch order; requests given no tokens were not in the decision.
        num_scheduled_tokens={r: n for r, n in zip(order, msg.num_scheduled_tokens) if n}
        if msg.num_scheduled_tokens else dict.fromkeys(order, 1),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        preempted_req_ids=set(msg.preempted_req_ids),
        step_id=msg.step_id,
    )


def model_runner_output_to_pb(o: m.ModelRunnerOutput, scheduled: list[str] | None = None
                              ) -> w_pb.ModelRunnerOutput:
    """`scheduled`: the step's scheduled request ids in batch order (`num_scheduled_tokens`' keys)."""
    sampled = o.sampled_token_ids
    as_scheduled = bool(scheduled) and o.req_ids == scheduled
    msg = w_pb.ModelRunnerOutput(
        req_ids=[] if as_scheduled else o.req_ids,
        req_ids_as_scheduled=as_scheduled,
        sampled_token_ids=list(chain.from_iterable(sampled)),
        num_sampled_token_ids=one_each_or_counts(sampled),
        prepare_ns=o.prepare_ns,
        forward_ns=o.forward_ns,
        sample_ns=o.sample_ns,
        step_id=o.step_id,
    )
    logprobs = o.logprobs
    if logprobs.count(None) != len(logprobs):
        indices = [i for i, lp in enumerate(logprobs) if lp is not None]
        msg.logprobs_req_indices.extend(indices)
        msg.logprobs.extend([token_logprobs_to_pb(logprobs[i]) for i in indices])
    return msg


def model_runner_output_from_pb(msg: w_pb.ModelRunnerOutput, scheduled: list[str] | None = None
                                ) -> m.ModelRunnerOutput:
    """`scheduled`: the step's scheduled request ids in batch order, as sent to the worker."""
    req_ids = ids_or_referred(msg.req_ids, msg.req_ids_as_scheduled, scheduled, "its step's requests")
    sampled = split_one_each_or_counts(list(msg.sampled_token_ids), list(msg.num_sampled_token_ids))
    logprobs: list[m.TokenLogprobs | None] = [None] * len(req_ids)
    for i, lp in zip(msg.logprobs_req_indices, msg.logprobs):
        logprobs[i] = token_logprobs_from_pb(lp)
    return m.ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prepare_ns=msg.prepare_ns,
        forward_ns=msg.forward_ns,
        sample_ns=msg.sample_ns,
        step_id=msg.step_id,
    )


def kv_cache_spec_to_pb(spec: m.KVCacheSpec) -> w_pb.DescribeKVCacheResponse:
    return w_pb.DescribeKVCacheResponse(**vars(spec))


def kv_cache_spec_from_pb(msg: w_pb.DescribeKVCacheResponse) -> m.KVCacheSpec:
    return flat_from_pb(m.KVCacheSpec, msg)


class StepEncoder:
    """The scheduler's end of one step stream: each step is encoded against the one sent before it."""

    def __init__(self) -> None:
        self.last_order: list[str] | None = None

    def encode(self, s: m.SchedulerOutput) -> w_pb.SchedulerOutput:
        msg = scheduler_output_to_pb(s, self.last_order)
        self.last_order = step_order(s)
        return msg


class StepDecoder:
    """The worker's end of one step stream: each step is decoded against the one received before it."""

    def __init__(self) -> None:
        self.last_order: list[str] | None = None

    def decode(self, msg: w_pb.SchedulerOutput) -> m.SchedulerOutput:
        try:
            s = scheduler_output_from_pb(msg, self.last_order)
        except Exception:
            self.forget()
            raise
        self.last_order = step_order(s)
        return s

    def forget(self) -> None:
        """After a step that failed: a later step sent against it is refused rather than run on this
        end's counts, which the failed step may have left behind the scheduler's."""
        self.last_order = None
