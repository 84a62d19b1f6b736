"""Converts protobuf messages to the plain dataclasses of `messages` and back.

The only module, besides the gRPC servers and clients, that touches generated code.
"""
from __future__ import annotations

from services.common import messages as m
from services.common.pb import engine_core_pb2 as ec_pb
from services.common.pb import worker_pb2 as w_pb


# --- sampling params ---------------------------------------------------------------------------
def sampling_params_to_pb(p: m.SamplingParams) -> ec_pb.SamplingParams:
    msg = ec_pb.SamplingParams(
        n=p.n,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=p.logit_bias,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def sampling_params_from_pb(msg: ec_pb.SamplingParams) -> m.SamplingParams:
    """Decodes sampling params; proto3 zero values of multiplicative knobs mean "unset"."""
    return m.SamplingParams(
        n=msg.n or 1,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty > 0 else 1.0,
        logit_bias=dict(msg.logit_bias),
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


# --- frontend <-> scheduler ----------------------------------------------------------------------
def engine_core_request_to_pb(r: m.EngineCoreRequest) -> ec_pb.EngineCoreRequest:
    return ec_pb.EngineCoreRequest(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        sampling_params=sampling_params_to_pb(r.sampling_params),
        arrival_time=r.arrival_time,
        priority=r.priority,
        eos_token_ids=r.eos_token_ids,
        cache_salt=r.cache_salt,
        traceparent=r.traceparent,
        tracestate=r.tracestate,
    )


def engine_core_request_from_pb(msg: ec_pb.EngineCoreRequest) -> m.EngineCoreRequest:
    return m.EngineCoreRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=sampling_params_from_pb(msg.sampling_params),
        arrival_time=msg.arrival_time,
        priority=msg.priority,
        eos_token_ids=tuple(msg.eos_token_ids),
        cache_salt=msg.cache_salt,
        traceparent=msg.traceparent,
        tracestate=msg.tracestate,
    )


def token_logprobs_to_pb(lp: m.TokenLogprobs | None) -> ec_pb.TokenLogprobs:
    if lp is None:  # rank 0 marks "absent": real ranks start at 1
        return ec_pb.TokenLogprobs()
    return ec_pb.TokenLogprobs(
        logprob=lp.logprob,
        rank=lp.rank,
        top_logprobs=[ec_pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top_logprobs],
    )


def token_logprobs_from_pb(msg: ec_pb.TokenLogprobs) -> m.TokenLogprobs | None:
    if msg.rank == 0:
        return None
    return m.TokenLogprobs(
        logprob=msg.logprob,
        rank=msg.rank,
        top_logprobs=[(t.token_id, t.logprob) for t in msg.top_logprobs],
    )


def scheduler_stats_to_pb(s: m.SchedulerStats) -> ec_pb.SchedulerStats:
    return ec_pb.SchedulerStats(**vars(s))


def scheduler_stats_from_pb(msg: ec_pb.SchedulerStats) -> m.SchedulerStats:
    return m.SchedulerStats(**{name: getattr(msg, name) for name in vars(m.SchedulerStats())})


def engine_core_output_to_pb(o: m.EngineCoreOutput) -> ec_pb.EngineCoreOutput:
    msg = ec_pb.EngineCoreOutput(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        new_logprobs=[token_logprobs_to_pb(lp) for lp in o.new_logprobs],
        finish_reason=int(o.finish_reason),
        num_cached_tokens=o.num_cached_tokens,
        events=[ec_pb.RequestEvent(type=int(e.type), timestamp=e.timestamp) for e in o.events],
        error_message=o.error_message,
        error_code=o.error_code,
    )
    if o.stop_reason is not None:
        msg.stop_reason = o.stop_reason
    return msg


def engine_core_output_from_pb(msg: ec_pb.EngineCoreOutput) -> m.EngineCoreOutput:
    return m.EngineCoreOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        new_logprobs=[token_logprobs_from_pb(lp) for lp in msg.new_logprobs],
        finish_reason=m.FinishReason(msg.finish_reason),
        stop_reason=msg.stop_reason if msg.HasField("stop_reason") else None,
        num_cached_tokens=msg.num_cached_tokens,
        events=[m.RequestEvent(m.RequestEventType(e.type), e.timestamp) for e in msg.events],
        error_message=msg.error_message,
        error_code=msg.error_code,
    )


def engine_core_outputs_to_pb(o: m.EngineCoreOutputs) -> ec_pb.EngineCoreOutputs:
    msg = ec_pb.EngineCoreOutputs(
        outputs=[engine_core_output_to_pb(x) for x in o.outputs], timestamp=o.timestamp
    )
    if o.scheduler_stats is not None:
        msg.scheduler_stats.CopyFrom(scheduler_stats_to_pb(o.scheduler_stats))
    return msg


def engine_core_outputs_from_pb(msg: ec_pb.EngineCoreOutputs) -> m.EngineCoreOutputs:
    return m.EngineCoreOutputs(
        outputs=[engine_core_output_from_pb(x) for x in msg.outputs],
        scheduler_stats=scheduler_stats_from_pb(msg.scheduler_stats) if msg.HasField("scheduler_stats") else None,
        timestamp=msg.timestamp,
    )


def engine_info_to_pb(info: m.EngineInfo) -> ec_pb.GetEngineInfoResponse:
    return ec_pb.GetEngineInfoResponse(**vars(info))


def engine_info_from_pb(msg: ec_pb.GetEngineInfoResponse) -> m.EngineInfo:
    return m.EngineInfo(
        model_name=msg.model_name,
        max_model_len=msg.max_model_len,
        block_size=msg.block_size,
        num_gpu_blocks=msg.num_gpu_blocks,
        device=msg.device,
        dtype=msg.dtype,
        vocab_size=msg.vocab_size,
    )


# --- scheduler <-> worker ------------------------------------------------------------------------
def scheduler_output_to_pb(s: m.SchedulerOutput) -> w_pb.SchedulerOutput:
    c = s.scheduled_cached_reqs
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
            for r in s.scheduled_new_reqs
        ],
        scheduled_cached_reqs=w_pb.CachedRequestData(
            req_ids=c.req_ids,
            resumed_from_preemption=c.resumed_from_preemption,
            new_block_ids=[w_pb.BlockIds(block_ids=b) for b in c.new_block_ids],
            num_computed_tokens=c.num_computed_tokens,
            resumed_token_ids=[ec_pb.TokenIds(token_ids=t) for t in c.resumed_token_ids],
        ),
        num_scheduled_tokens=s.num_scheduled_tokens,
        total_num_scheduled_tokens=s.total_num_scheduled_tokens,
        finished_req_ids=sorted(s.finished_req_ids),
        preempted_req_ids=sorted(s.preempted_req_ids),
        step_id=s.step_id,
    )


def scheduler_output_from_pb(msg: w_pb.SchedulerOutput) -> m.SchedulerOutput:
    c = msg.scheduled_cached_reqs
    return m.SchedulerOutput(
        scheduled_new_reqs=[
            m.NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=sampling_params_from_pb(r.sampling_params),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                traceparent=r.traceparent,
            )
            for r in msg.scheduled_new_reqs
        ],
        scheduled_cached_reqs=m.CachedRequestData(
            req_ids=list(c.req_ids),
            resumed_from_preemption=list(c.resumed_from_preemption),
            new_block_ids=[list(b.block_ids) for b in c.new_block_ids],
            num_computed_tokens=list(c.num_computed_tokens),
            resumed_token_ids=[list(t.token_ids) for t in c.resumed_token_ids],
        ),
        # protobuf maps do not keep insertion order; the batch order is new requests, then cached
        # requests, as the scheduler built them.
        num_scheduled_tokens=_ordered_num_scheduled_tokens(msg),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        preempted_req_ids=set(msg.preempted_req_ids),
        step_id=msg.step_id,
    )


def _ordered_num_scheduled_tokens(msg: w_pb.SchedulerOutput) -> dict[str, int]:
    counts = msg.num_scheduled_tokens
    order = [r.req_id for r in msg.scheduled_new_reqs] + list(msg.scheduled_cached_reqs.req_ids)
    return {req_id: counts[req_id] for req_id in order if req_id in counts}


def model_runner_output_to_pb(o: m.ModelRunnerOutput) -> w_pb.ModelRunnerOutput:
    return w_pb.ModelRunnerOutput(
        req_ids=o.req_ids,
        sampled_token_ids=[ec_pb.TokenIds(token_ids=t) for t in o.sampled_token_ids],
        logprobs=[token_logprobs_to_pb(lp) for lp in o.logprobs],
        prepare_ns=o.prepare_ns,
        forward_ns=o.forward_ns,
        sample_ns=o.sample_ns,
        step_id=o.step_id,
    )


def model_runner_output_from_pb(msg: w_pb.ModelRunnerOutput) -> m.ModelRunnerOutput:
    return m.ModelRunnerOutput(
        req_ids=list(msg.req_ids),
        sampled_token_ids=[list(t.token_ids) for t in msg.sampled_token_ids],
        logprobs=[token_logprobs_from_pb(lp) for lp in msg.logprobs],
        prepare_ns=msg.prepare_ns,
        forward_ns=msg.forward_ns,
        sample_ns=msg.sample_ns,
        step_id=msg.step_id,
    )


def kv_cache_spec_to_pb(spec: m.KVCacheSpec) -> w_pb.DescribeKVCacheResponse:
    return w_pb.DescribeKVCacheResponse(**vars(spec))


def kv_cache_spec_from_pb(msg: w_pb.DescribeKVCacheResponse) -> m.KVCacheSpec:
    return m.KVCacheSpec(
        block_size=msg.block_size,
        num_blocks=msg.num_blocks,
        block_bytes=msg.block_bytes,
        max_model_len=msg.max_model_len,
        model_name=msg.model_name,
        device=msg.device,
        dtype=msg.dtype,
        vocab_size=msg.vocab_size,
    )
