"""Converts the frontend <-> scheduler protobuf messages (engine_core.proto) to the plain
dataclasses of `messages` and back; `worker_codec` does the same for the scheduler <-> worker ones.

These two convert the internal protocol; the public gRPC API has its own proto and converter
(`services/frontend/grpc_codec.py`), so either side can change alone.

Per-step messages (EngineCoreOutputs here, SchedulerOutput and ModelRunnerOutput in `worker_codec`)
travel in columns: per-request lists are flattened into one packed field plus a count per request,
because a sub-message per request per step costs far more to build and parse than the data in it.
"""
from __future__ import annotations

import dataclasses
from itertools import accumulate, chain

from services.common import messages
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, to_int64
from services.common.pb import engine_core_pb2 as ec_pb
from services.common.structured_outputs import StructuredOutputsParams


# --- sampling params ---------------------------------------------------------------------------
def sampling_params_to_pb(p: messages.SamplingParams) -> ec_pb.SamplingParams:
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
    if p.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_pb(p.structured_outputs))
    return msg


def structured_outputs_to_pb(p: StructuredOutputsParams) -> ec_pb.StructuredOutputsParams:
    return ec_pb.StructuredOutputsParams(kind=p.kind, spec=p.spec, any_whitespace=p.any_whitespace)


def structured_outputs_from_pb(msg: ec_pb.StructuredOutputsParams) -> StructuredOutputsParams:
    return StructuredOutputsParams(kind=msg.kind, spec=msg.spec, any_whitespace=msg.any_whitespace)


def sampling_params_from_pb(msg: ec_pb.SamplingParams) -> messages.SamplingParams:
    """Decodes sampling params; proto3 zero values of multiplicative knobs mean "unset"."""
    return messages.SamplingParams(
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
        structured_outputs=(structured_outputs_from_pb(msg.structured_outputs)
                            if msg.HasField("structured_outputs") else None),
    )


# --- frontend <-> scheduler ----------------------------------------------------------------------
def engine_core_request_to_pb(r: messages.EngineCoreRequest) -> ec_pb.EngineCoreRequest:
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


def engine_core_request_from_pb(msg: ec_pb.EngineCoreRequest) -> messages.EngineCoreRequest:
    return messages.EngineCoreRequest(
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


def token_logprobs_to_pb(lp: messages.TokenLogprobs | None) -> ec_pb.TokenLogprobs:
    if lp is None:  # rank 0 marks "absent": real ranks start at 1
        return ec_pb.TokenLogprobs()
    return ec_pb.TokenLogprobs(
        logprob=lp.logprob,
        rank=lp.rank,
        top_logprobs=[ec_pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top_logprobs],
    )


def token_logprobs_from_pb(msg: ec_pb.TokenLogprobs) -> messages.TokenLogprobs | None:
    if msg.rank == 0:
        return None
    return messages.TokenLogprobs(
        logprob=msg.logprob,
        rank=msg.rank,
        top_logprobs=[(t.token_id, t.logprob) for t in msg.top_logprobs],
    )


def scheduler_stats_to_pb(stats: messages.SchedulerStats) -> ec_pb.SchedulerStats:
    return ec_pb.SchedulerStats(**vars(stats))


def scheduler_stats_from_pb(msg: ec_pb.SchedulerStats) -> messages.SchedulerStats:
    return messages.SchedulerStats(**{name: getattr(msg, name) for name in vars(messages.SchedulerStats())})


def engine_core_output_to_pb(request_id: str, new_token_ids: list[int], extras: messages.OutputExtras) -> ec_pb.EngineCoreOutput:
    msg = ec_pb.EngineCoreOutput(
        request_id=request_id,
        new_token_ids=new_token_ids,
        new_logprobs=[token_logprobs_to_pb(lp) for lp in extras.new_logprobs],
        finish_reason=int(extras.finish_reason),
        num_cached_tokens=extras.num_cached_tokens,
        events=[ec_pb.RequestEvent(type=int(e.type), timestamp=e.timestamp) for e in extras.events],
        error_message=extras.error_message,
        error_code=extras.error_code,
    )
    if extras.stop_reason is not None:
        msg.stop_reason = extras.stop_reason
    return msg


def output_extras_from_pb(msg: ec_pb.EngineCoreOutput) -> messages.OutputExtras:
    return messages.OutputExtras(
        new_logprobs=[token_logprobs_from_pb(lp) for lp in msg.new_logprobs],
        finish_reason=messages.FinishReason(msg.finish_reason),
        stop_reason=msg.stop_reason if msg.HasField("stop_reason") else None,
        num_cached_tokens=msg.num_cached_tokens,
        events=[messages.RequestEvent(messages.RequestEventType(e.type), e.timestamp) for e in msg.events],
        error_message=msg.error_message,
        error_code=msg.error_code,
    )


def engine_core_outputs_to_pb(outputs: messages.EngineCoreOutputs, last_plain_req_ids: list[str] | None = None
                              ) -> tuple[ec_pb.EngineCoreOutputs, list[str]]:
    """The message, and its plain request ids (outputs of new tokens only, which travel in the
    columns). `last_plain_req_ids`: those of the last message on the same stream that had any."""
    extras = outputs.extras
    if extras:
        plain = [(r, t) for r, t in zip(outputs.req_ids, outputs.new_token_ids) if r not in extras]
        plain_req_ids = [r for r, _ in plain]
        token_ids = [t for _, t in plain]
        full = [engine_core_output_to_pb(r, t, extras[r]) for r, t in zip(outputs.req_ids, outputs.new_token_ids) if r in extras]
    else:  # the usual step: the columns as they are
        plain_req_ids, token_ids, full = outputs.req_ids, outputs.new_token_ids, []
    as_last = bool(last_plain_req_ids) and plain_req_ids == last_plain_req_ids
    msg = ec_pb.EngineCoreOutputs(
        outputs=full,
        timestamp=outputs.timestamp,
        request_ids=[] if as_last else plain_req_ids,
        request_ids_as_last=as_last,
        num_new_token_ids=one_each_or_counts(token_ids),
        new_token_ids=list(chain.from_iterable(token_ids)),
    )
    if outputs.scheduler_stats is not None:
        msg.scheduler_stats.CopyFrom(scheduler_stats_to_pb(outputs.scheduler_stats))
    return msg, plain_req_ids


def engine_core_outputs_from_pb(msg: ec_pb.EngineCoreOutputs, last_plain_req_ids: list[str] | None = None
                                ) -> tuple[messages.EngineCoreOutputs, list[str]]:
    """The outputs (those with extras first), and the message's plain request ids.
    `last_plain_req_ids`: those of the last message on the same stream that had any."""
    plain_req_ids = ids_or_referred(msg.request_ids, msg.request_ids_as_last, last_plain_req_ids,
                                    "the last message's requests")
    plain_token_ids = split_one_each_or_counts(list(msg.new_token_ids), list(msg.num_new_token_ids))
    if len(plain_token_ids) != len(plain_req_ids):
        raise ValueError(f"a message has {len(plain_req_ids)} plain request ids but {len(plain_token_ids)} token lists")
    outputs = messages.EngineCoreOutputs(
        scheduler_stats=scheduler_stats_from_pb(msg.scheduler_stats) if msg.HasField("scheduler_stats") else None,
        timestamp=msg.timestamp,
    )
    if msg.outputs:
        for full in msg.outputs:
            outputs.append(full.request_id, list(full.new_token_ids), output_extras_from_pb(full))
        outputs.req_ids += plain_req_ids
        outputs.new_token_ids += plain_token_ids
    else:
        outputs.req_ids, outputs.new_token_ids = list(plain_req_ids), plain_token_ids
    return outputs, plain_req_ids


class OutputsEncoder:
    """The scheduler's end of one frontend stream: remembers the last plain request ids sent."""

    def __init__(self) -> None:
        self.last_plain_req_ids: list[str] | None = None

    def encode(self, outputs: messages.EngineCoreOutputs) -> ec_pb.EngineCoreOutputs:
        msg, plain_req_ids = engine_core_outputs_to_pb(outputs, self.last_plain_req_ids)
        if plain_req_ids:
            self.last_plain_req_ids = plain_req_ids
        return msg


class OutputsDecoder:
    """The frontend's end of one scheduler stream: remembers the last plain request ids received."""

    def __init__(self) -> None:
        self.last_plain_req_ids: list[str] | None = None

    def decode(self, msg: ec_pb.EngineCoreOutputs) -> messages.EngineCoreOutputs:
        outputs, plain_req_ids = engine_core_outputs_from_pb(msg, self.last_plain_req_ids)
        if plain_req_ids:
            self.last_plain_req_ids = plain_req_ids
        return outputs


def ids_or_referred(ids, refers: bool, referred: list[str] | None, what: str) -> list[str]:
    """A message's request ids, or a copy of the ids it refers to (sent before, so left out)."""
    if not refers:
        return list(ids)
    if not referred:
        raise ValueError(f"a message refers to {what}, which this end of the stream does not have")
    return list(referred)


def one_each_or_counts(lists: list[list[int]]) -> list[int]:
    """The count column of token lists: empty when each holds exactly one token (a decode step)."""
    counts = list(map(len, lists))
    return [] if counts.count(1) == len(counts) else counts


def split_one_each_or_counts(flat: list[int], counts: list[int]) -> list[list[int]]:
    """Inverse of `one_each_or_counts`: empty counts mean one token each."""
    return split_column(flat, counts) if counts else [[t] for t in flat]


def split_column(flat: list[int], counts: list[int]) -> list[list[int]]:
    """Cuts a concatenated column back into one list per entry (`counts[i]` items each); ValueError
    if the counts do not cut it exactly."""
    if len(flat) == len(counts) and counts.count(1) == len(counts):
        return [[x] for x in flat]  # the decode step: one token each
    if sum(counts) != len(flat) or (counts and min(counts) < 0):
        raise ValueError(f"a column of {len(flat)} items does not split into {len(counts)} counts")
    return [flat[end - n:end] for n, end in zip(counts, accumulate(counts))]


def flat_from_pb(cls, msg):
    """A dataclass of scalar fields from the message with the same field names (the `**vars` inverse)."""
    return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})


def engine_info_to_pb(info: messages.EngineInfo) -> ec_pb.GetEngineInfoResponse:
    return ec_pb.GetEngineInfoResponse(**vars(info))


def engine_info_from_pb(msg: ec_pb.GetEngineInfoResponse) -> messages.EngineInfo:
    return flat_from_pb(messages.EngineInfo, msg)


# --- prefix-cache events (engine core -> frontend) -------------------------------------------------
def kv_event_batch_to_pb(batch: KVEventBatch) -> ec_pb.KvEventBatch:
    msg = ec_pb.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp)
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored = ec_pb.KvBlocksStored(block_hashes=[to_int64(h) for h in event.block_hashes],
                                          token_ids=event.token_ids, block_size=event.block_size)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = to_int64(event.parent_block_hash)
            msg.events.add(stored=stored)
        elif isinstance(event, BlockRemoved):
            msg.events.add(removed=ec_pb.KvBlocksRemoved(block_hashes=[to_int64(h) for h in event.block_hashes]))
        else:
            msg.events.add(cleared=ec_pb.KvAllBlocksCleared())
    return msg


def kv_event_batch_from_pb(msg: ec_pb.KvEventBatch) -> KVEventBatch:
    """Hashes stay signed 64-bit, as the engine gRPC API sends them."""
    events: list = []
    for event in msg.events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            s = event.stored
            events.append(BlockStored(list(s.block_hashes), s.parent_block_hash if s.HasField("parent_block_hash")
                                      else None, list(s.token_ids), s.block_size))
        elif kind == "removed":
            events.append(BlockRemoved(list(event.removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
    return KVEventBatch(msg.sequence_number, msg.timestamp, events)
