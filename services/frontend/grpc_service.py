"""GenerateService: the frontend's gRPC face, with the same validation as the HTTP API.

`Generate` is one server-streaming call per request; each response holds the text and token ids
of one choice new since its previous response, the last one of a choice its finish reason. `n` > 1
interleaves the choices (told apart by `index`). Errors map to status codes: INVALID_ARGUMENT (bad
input), NOT_FOUND (unknown model, unknown request id for Abort), RESOURCE_EXHAUSTED (engine queue
full), UNAVAILABLE (engine not ready, draining, engine down), CANCELLED (ended by Abort), INTERNAL.
A client that cancels the call aborts its requests in the engine, as Abort does.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

import grpc

from services.common.codec import sampling_params_from_pb, token_logprobs_to_pb
from services.common.messages import FinishReason
from services.common.pb import engine_core_pb2, generate_pb2, generate_pb2_grpc
from services.frontend.errors import APIError, EngineError, from_engine_error, invalid_request
from services.frontend.protocol import GenerationOptions, check_sampling_params
from services.frontend.serving_engine import OpenAIServing
from services.frontend.tokenizer import encode_prompt

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name

_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class RequestAborted(Exception):
    """An Abort call ended the request."""


def status_code(err: APIError) -> grpc.StatusCode:
    return _STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL)


def _as_status(unary):
    """Runs a unary handler, turning the frontend's errors into status codes."""
    @functools.wraps(unary)
    async def handler(self, request, context):
        try:
            return await unary(self, request, context)
        except APIError as err:
            await context.abort(status_code(err), _describe(err))
        except EngineError as exc:
            err = from_engine_error(exc)
            await context.abort(status_code(err), _describe(err))
    return handler


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        # request_id -> set when Abort names it
        self._running: dict[str, asyncio.Event] = {}

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            async for response in self._generate(request):
                yield response
        except APIError as err:
            await context.abort(status_code(err), _describe(err))
        except EngineError as exc:
            err = from_engine_error(exc)
            await context.abort(status_code(err), _describe(err))
        except RequestAborted:
            await context.abort(grpc.StatusCode.CANCELLED, "aborted by an Abort call")

    @_as_status
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context: Any) -> generate_pb2.TokenizeResponse:
        serving = self.serving
        serving.check_model(request.model or None)
        serving.check_ready()  # max_model_len comes from the engine
        add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = list(serving.model.tokenizer.encode(request.text, add_special_tokens=add_special_tokens))
        return generate_pb2.TokenizeResponse(
            token_ids=token_ids, tokens=serving.model.tokenizer.convert_ids_to_tokens(token_ids),
            max_model_len=serving.max_model_len)

    @_as_status
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest, context: Any
                           ) -> generate_pb2.GetModelInfoResponse:
        serving = self.serving
        serving.check_ready()
        info = serving.engine_client.info
        return generate_pb2.GetModelInfoResponse(
            model_name=serving.model.name, max_model_len=serving.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=list(serving.model.eos_token_ids), block_size=info.block_size, device=info.device,
            dtype=info.dtype)

    @_as_status
    async def Abort(self, request: generate_pb2.AbortRequest, context: Any) -> generate_pb2.AbortResponse:
        event = self._running.get(request.request_id)
        if event is None:
            raise APIError(404, f"No running request with id {request.request_id!r}.", "invalid_request_error",
                           param="request_id")
        event.set()
        return generate_pb2.AbortResponse()

    async def _generate(self, request: generate_pb2.GenerateRequest) -> AsyncIterator[generate_pb2.GenerateResponse]:
        serving = self.serving
        options = _options(request)
        serving.check_model(options.model)
        serving.check_ready()
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise invalid_request("'text' must not be empty.", param="text")
            prompt_token_ids = encode_prompt(serving.model.tokenizer, request.text)
        elif kind == "token_ids":
            prompt_token_ids = list(request.token_ids.token_ids)
        else:
            raise invalid_request("Set 'text' or 'token_ids'.", param="input")
        response_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        if response_id in self._running:
            raise invalid_request(f"A request with id {response_id!r} is already running.", param="request_id")
        # The engine's ids are always ours: ids chosen by clients could collide between clients.
        choices = serving.make_choices(f"gen-{uuid.uuid4().hex}", prompt_token_ids, options, "input")
        aborted = self._running[response_id] = asyncio.Event()
        try:
            with serving.state.track():
                async with aclosing(serving.generate_choices(choices)) as deltas, \
                        aclosing(_until_set(deltas, aborted)) as until_aborted:
                    async for index, delta in until_aborted:
                        yield generate_pb2.GenerateResponse(
                            request_id=response_id,
                            text=delta.text,
                            token_ids=delta.token_ids,
                            finish_reason=int(_FINISH_REASONS.get(delta.finish_reason, FinishReason.NONE)),
                            num_prompt_tokens=len(prompt_token_ids),
                            num_completion_tokens=choices[index].num_output_tokens,
                            num_cached_tokens=delta.num_cached_tokens,
                            index=index,
                            logprobs=[token_logprobs_to_pb(lp) for lp in delta.logprobs],
                        )
        finally:
            self._running.pop(response_id, None)


async def _until_set(stream: AsyncIterator[Any], event: asyncio.Event) -> AsyncIterator[Any]:
    """Yields from `stream` until it ends, or raises RequestAborted once `event` is set.

    The pending read is cancelled on the way out, which closes `stream` (aborting its requests).
    """
    waiter = asyncio.ensure_future(event.wait())
    pending: asyncio.Future | None = None

    async def next_item() -> Any:
        return await anext(stream)

    try:
        while True:
            pending = asyncio.ensure_future(next_item())
            await asyncio.wait({pending, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                raise RequestAborted
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        waiter.cancel()
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending


def _options(request: generate_pb2.GenerateRequest) -> GenerationOptions:
    """Proto3 zero values mean "unset", as in the codec: max_tokens 0 is "as many as fit"."""
    pb_params = request.sampling_params if request.HasField("sampling_params") else engine_core_pb2.SamplingParams()
    params = sampling_params_from_pb(pb_params)
    if params.top_k == -1:
        params = dataclasses.replace(params, top_k=0)  # vLLM spells "disabled" as -1
    check_sampling_params(params)
    if params.max_tokens < 0:
        raise invalid_request("'max_tokens' must be >= 0 (0: as many as fit).", param="max_tokens")
    stop = tuple(request.stop)
    if not all(stop):
        raise invalid_request("Stop strings must not be empty.", param="stop")
    return GenerationOptions(
        model=request.model or None,
        sampling_params=params,
        max_tokens=params.max_tokens or None,
        max_tokens_param="max_tokens",
        stop=stop,
        include_stop_str_in_output=request.include_stop_str_in_output,
        priority=request.priority,
    )


def _describe(err: APIError) -> str:
    return f"{err.message} (param: {err.param})" if err.param else err.message
