"""`vllm.grpc.engine.VllmEngine`: vLLM's engine gRPC protocol (what the SMG gateway and other
routers speak to engines), a thin face over the frontend's one serving path as `GenerateService` is.

Generate validates as the HTTP API does (`codec`), runs the choices through `OpenAIServing` and
answers with the protocol's chunks and completes (`responses`). Errors are status codes as in
GenerateService: INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED (engine queue full),
UNAVAILABLE (engine not ready, draining, engine down), INTERNAL. A client that cancels the call
aborts its requests in the engine. Abort ends the caller's own running calls named by
`request_id` (scoped by caller identity, as in GenerateService; another caller's id and unknown ids
are ignored, as vLLM ignores unknown ones): each unfinished choice gets a `complete` with reason
"abort" and the call ends OK, as vLLM ends an aborted request.

HealthCheck always answers OK, with `healthy` true only while the engine serves (the gateway
detects the protocol by the call succeeding, then reads the flag). GetModelInfo reports the model
folder as `model_path` and no tokenizer path: SMG loads the tokenizer from that path when it is on
the same host and otherwise fetches it with GetTokenizer. FlushCache resets the engine's prefix
cache; SubscribeKvEvents streams its stored / removed / cleared blocks (kv_events.py). Embed and the
profiler calls are UNIMPLEMENTED, which the gateway takes as "not supported".
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from services.frontend.api_keys import ApiKeys, caller_identity
from services.frontend.app import spindle_version
from services.frontend.errors import APIError, EngineError, invalid_request, service_unavailable
# GenerateService's error mapping and Abort race, shared rather than copied.
from services.frontend.grpc_service import RequestAborted, as_status, stream_with_status, until_set
from services.frontend.serving_engine import OpenAIServing
from services.frontend.vllm_engine.kv_events import KvEventBatchEncoder
from services.frontend.vllm_engine.codec import SamplingDefaults, generate_request_from_pb, prompt_param
from services.frontend.vllm_engine.responses import GenerateResponses
from services.frontend.vllm_engine.tokenizer_bundle import TokenizerBundle

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# What GetServerInfo calls this server; the gateway reads no meaning into it (it drops the label).
SERVER_TYPE = "spindle-grpc"
FLUSH_POLL_S = 0.05


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`model_dir`: the served model's folder (config.json, tokenizer files); None when the
    frontend was handed a tokenizer without one (tests), which leaves GetTokenizer refused."""

    def __init__(self, serving: OpenAIServing, api_keys: ApiKeys | None = None, model_dir: Path | None = None,
                 defaults: SamplingDefaults = SamplingDefaults()):
        self.serving = serving
        self.api_keys = api_keys if api_keys is not None else ApiKeys()
        self.model_dir = model_dir
        self.defaults = defaults
        self._bundle = TokenizerBundle(model_dir) if model_dir is not None else None
        self._model_config = _read_model_config(model_dir)
        self._started_at = time.time()
        self._last_receive_time = 0.0
        # (caller identity, request_id) -> set when Abort names it
        self._running: dict[tuple[str, str], asyncio.Event] = {}

    # --- generation --------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self._last_receive_time = time.time()
        async for response in stream_with_status(self._generate(request, caller_identity(self.api_keys, context)),
                                                 context):
            yield response

    async def _generate(self, request: pb.GenerateRequest, caller: str) -> AsyncIterator[pb.GenerateResponse]:
        serving = self.serving
        generate = generate_request_from_pb(request, self.defaults)  # validated first, as the HTTP API does
        options = generate.options
        await serving.wait_ready()
        await serving.check_constraint(options)
        if isinstance(generate.prompt, str):  # tokenized as a completions prompt is
            prompt_token_ids = await serving.async_tokenizer.encode_prompt(generate.prompt)
        else:
            prompt_token_ids = generate.prompt
        key = (caller, request.request_id or f"vllm-{uuid.uuid4().hex}")
        if key in self._running:
            raise invalid_request(f"A request with id {key[1]!r} is already running.", param="request_id")
        # The engine's ids are always ours: ids chosen by clients could collide between clients.
        choices = serving.make_choices(f"vllm-{uuid.uuid4().hex}", prompt_token_ids, options,
                                       prompt_param(generate.prompt))
        responses = GenerateResponses(choices, options.is_stream, options.sampling_params.logprobs)
        aborted = self._running[key] = asyncio.Event()
        try:
            with serving.state.track():
                async with aclosing(serving.generate_choices(choices, final_only=not options.is_stream)) as deltas, \
                        aclosing(until_set(deltas, aborted)) as until_aborted:
                    try:
                        async for index, delta in until_aborted:
                            for response in responses.on_delta(index, delta):
                                yield response
                    except RequestAborted:
                        for response in responses.on_abort():
                            yield response
        finally:
            self._running.pop(key, None)

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        caller = caller_identity(self.api_keys, context)
        for request_id in request.request_ids:
            event = self._running.get((caller, request_id))
            if event is not None:  # unknown, finished, or another caller's: nothing to do
                event.set()
        return pb.AbortResponse()

    # --- state -------------------------------------------------------------------------------------
    async def HealthCheck(self, request: pb.HealthCheckRequest, context: Any) -> pb.HealthCheckResponse:
        try:
            self.serving.check_ready()
        except APIError as err:
            return pb.HealthCheckResponse(healthy=False, message=err.message)
        return pb.HealthCheckResponse(healthy=True, message="serving")

    @as_status
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.GetModelInfoResponse:
        serving = self.serving
        info = serving.engine_client.info
        if info is None:  # the context length and vocabulary come from the engine
            raise service_unavailable("The engine is not ready; try again shortly.")
        tokenizer = serving.model.tokenizer
        max_model_len = serving.max_model_len
        return pb.GetModelInfoResponse(
            model_path=str(self.model_dir) if self.model_dir is not None else serving.model.name,
            is_generation=True,
            max_context_length=max_model_len,
            vocab_size=info.vocab_size,
            served_model_name=serving.model.name,
            tokenizer_path="",  # a path here would not exist on the gateway's host: GetTokenizer instead
            model_type=self._model_config.get("model_type", ""),
            architectures=self._model_config.get("architectures", []),
            eos_token_ids=list(serving.model.eos_token_ids),
            pad_token_id=tokenizer.pad_token_id or 0,
            bos_token_id=tokenizer.bos_token_id or 0,
            max_req_input_len=max_model_len - 1,  # at least one token of output
            default_sampling_params_json=self.defaults.to_json(),
        )

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Any) -> pb.GetServerInfoResponse:
        info = self.serving.engine_client.info
        return pb.GetServerInfoResponse(
            active_requests=self.serving.state.num_inflight,  # every face's requests
            is_paused=False,
            last_receive_timestamp=self._last_receive_time,
            uptime_seconds=time.time() - self._started_at,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            block_size=info.block_size if info is not None else 0,
            model_dtype=info.dtype if info is not None else "",
            attention_backend=info.attention_backend if info is not None else "",
            max_num_seqs=info.max_num_seqs if info is not None else 0,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Any) -> pb.GetLoadsResponse:
        """One rank's load from the engine's latest stats (zeros before the first)."""
        stats = self.serving.engine_client.last_stats
        info = self.serving.engine_client.info
        block_size = info.block_size if info is not None else 0
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs,
            num_total_reqs=stats.num_running_reqs + stats.num_waiting_reqs,
            num_used_tokens=(stats.num_total_blocks - stats.num_free_blocks) * block_size,
            max_total_num_tokens=stats.num_total_blocks * block_size,
            token_usage=stats.kv_cache_usage,
            # Since the engine started: the counters are cumulative.
            cache_hit_rate=stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0,
            max_running_requests=info.max_num_seqs if info is not None else 0,
        )
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=spindle_version(),
                                   dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._bundle is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "This server has no model folder to send.")
        try:
            bundle = await self._bundle.get()
        except FileNotFoundError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        for data, sha256 in bundle.chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)

    @as_status
    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context: Any) -> common_pb2.FlushCacheResponse:
        """Forgets the engine's cached prefixes once no request holds KV blocks, waiting up to
        `timeout_s` for that (0: now or not at all)."""
        engine = self.serving.engine_client
        deadline = time.monotonic() + max(0.0, request.timeout_s)
        while True:
            if await engine.reset_prefix_cache():
                return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False, message="requests hold KV blocks; retry, or give a timeout_s to wait for idle")
            await asyncio.sleep(FLUSH_POLL_S)

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The engine's prefix-cache events from now on: no replay, so the first batch clears what
        the subscriber knew (`start_sequence_number` is not honoured)."""
        encoder = KvEventBatchEncoder()
        try:
            async for batch in self.serving.engine_client.subscribe_kv_events():
                yield encoder.encode(batch)
        except EngineError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    # --- not served ----------------------------------------------------------------------------------

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> None:
        await _unimplemented(context, "Embed is not supported: this engine serves generative models only.")

    async def StartProfile(self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext) -> None:
        await _unimplemented(context, "Profiling is not supported.")

    async def StopProfile(self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext) -> None:
        await _unimplemented(context, "Profiling is not supported.")


async def _unimplemented(context: grpc.aio.ServicerContext, message: str) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)


def _read_model_config(model_dir: Path | None) -> dict[str, Any]:
    """model_type and architectures from the folder's config.json ({} without one)."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        return {}
    config = json.loads((model_dir / "config.json").read_text())
    return {"model_type": str(config.get("model_type") or ""),
            "architectures": [str(a) for a in config.get("architectures") or []]}
