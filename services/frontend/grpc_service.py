"""GenerateService: the frontend's gRPC face, with the same validation as the HTTP API.

`Generate` is one server-streaming call per request; each response holds the text and token ids
of one choice new since its previous response, the last one of a choice its finish reason. `n` > 1
interleaves the choices (told apart by `index`). Errors map to status codes: INVALID_ARGUMENT (bad
input), NOT_FOUND (unknown model, unknown request id for Abort), RESOURCE_EXHAUSTED (engine queue
full), UNAVAILABLE (engine not ready, draining, engine down), CANCELLED (ended by Abort), INTERNAL.
A client that cancels the call aborts its requests in the engine, as Abort does.

Request ids belong to their caller (services/frontend/api_keys.py `caller_identity`: the API key's
identity when keys are on, the connection otherwise): Abort finds only the caller's own running
requests, anyone else's id is NOT_FOUND as an unknown one is, and two callers may use the same id.

`grpc_codec` converts requests and responses to and from the frontend's dataclasses; the public
messages share no types with the internal protos, and nothing here touches those.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

import grpc

from services.common.pb import generate_pb2, generate_pb2_grpc
from services.frontend.api_keys import ApiKeys, caller_identity
from services.frontend.errors import APIError, EngineError, from_engine_error, invalid_request
from services.frontend.grpc_codec import generate_request_from_pb, generate_response_to_pb, model_info_to_pb
from services.frontend.serving_engine import OpenAIServing

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name

_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class RequestAborted(Exception):
    """An Abort call ended the request."""


def status_code(err: APIError) -> grpc.StatusCode:
    return _STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL)


def as_status(unary):
    """Runs a unary handler, turning the frontend's errors into status codes."""
    @functools.wraps(unary)
    async def handler(self, request, context):
        try:
            return await unary(self, request, context)
        except APIError as err:
            await context.abort(status_code(err), describe_error(err))
        except EngineError as exc:
            err = from_engine_error(exc)
            await context.abort(status_code(err), describe_error(err))
    return handler


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, serving: OpenAIServing, api_keys: ApiKeys | None = None):
        self.serving = serving
        self.api_keys = api_keys if api_keys is not None else ApiKeys()
        # (caller identity, request_id) -> set when Abort names it
        self._running: dict[tuple[str, str], asyncio.Event] = {}

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            async for response in stream_with_status(self._generate(request, caller_identity(self.api_keys, context)),
                                                     context):
                yield response
        except RequestAborted:
            await context.abort(grpc.StatusCode.CANCELLED, "aborted by an Abort call")

    @as_status
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context: Any) -> generate_pb2.TokenizeResponse:
        serving = self.serving
        serving.check_model(request.model or None)
        await serving.wait_ready()  # max_model_len comes from the engine
        add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = await serving.async_tokenizer.encode_prompt(request.text, add_special_tokens=add_special_tokens)
        return generate_pb2.TokenizeResponse(
            token_ids=token_ids, tokens=await serving.async_tokenizer.convert_ids_to_tokens(token_ids),
            max_model_len=serving.max_model_len)

    @as_status
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest, context: Any
                           ) -> generate_pb2.GetModelInfoResponse:
        serving = self.serving
        serving.check_ready()
        return model_info_to_pb(serving.model.name, serving.max_model_len, serving.model.eos_token_ids,
                                serving.engine_client.info)

    @as_status
    async def Abort(self, request: generate_pb2.AbortRequest, context: Any) -> generate_pb2.AbortResponse:
        event = self._running.get((caller_identity(self.api_keys, context), request.request_id))
        if event is None:  # unknown, finished, or another caller's: all look the same
            raise APIError(404, f"No running request with id {request.request_id!r}.", "invalid_request_error",
                           param="request_id")
        event.set()
        return generate_pb2.AbortResponse()

    async def _generate(self, request: generate_pb2.GenerateRequest, caller: str
                        ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        serving = self.serving
        generate = generate_request_from_pb(request)  # validated first, as the HTTP API does
        options = generate.options
        serving.check_model(options.model)
        await serving.wait_ready()
        await serving.check_constraint(options)
        if isinstance(generate.prompt, str):
            prompt_token_ids = await serving.async_tokenizer.encode_prompt(generate.prompt)
        else:
            prompt_token_ids = generate.prompt
        response_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        key = (caller, response_id)
        if key in self._running:
            raise invalid_request(f"A request with id {response_id!r} is already running.", param="request_id")
        # The engine's ids are always ours: ids chosen by clients could collide between clients.
        choices = serving.make_choices(f"gen-{uuid.uuid4().hex}", prompt_token_ids, options, "input")
        aborted = self._running[key] = asyncio.Event()
        try:
            with serving.state.track():
                async with aclosing(serving.generate_choices(choices)) as deltas, \
                        aclosing(until_set(deltas, aborted)) as until_aborted:
                    async for index, delta in until_aborted:
                        yield generate_response_to_pb(response_id, index, delta, len(prompt_token_ids),
                                                      choices[index].num_output_tokens)
        finally:
            self._running.pop(key, None)


async def until_set(stream: AsyncIterator[Any], event: asyncio.Event) -> AsyncIterator[Any]:
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


async def stream_with_status(stream: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    """Yields from a streaming handler's body; the frontend's errors end the call with their status
    code and the field they name."""
    try:
        async for item in stream:
            yield item
    except APIError as err:
        await context.abort(status_code(err), describe_error(err))
    except EngineError as exc:
        err = from_engine_error(exc)
        await context.abort(status_code(err), describe_error(err))


def describe_error(err: APIError) -> str:
    return f"{err.message} (param: {err.param})" if err.param else err.message
