"""GenerateService: the frontend's gRPC face, with the same validation as the HTTP API.

One server-streaming call per request; each response holds the text and token ids new since the
previous one, the last one its finish reason. Errors map to status codes: INVALID_ARGUMENT (bad
input), NOT_FOUND (unknown model), RESOURCE_EXHAUSTED (engine queue full), UNAVAILABLE (engine not
ready, draining, engine down), INTERNAL. A client that cancels the call aborts the request.
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from services.common.codec import sampling_params_from_pb
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


def status_code(err: APIError) -> grpc.StatusCode:
    return _STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL)


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

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
        # The engine's id is always ours: ids chosen by clients could collide between clients.
        engine_request = serving.make_engine_request(f"gen-{uuid.uuid4().hex}", prompt_token_ids, options, "input")
        detokenizer = serving.make_detokenizer(prompt_token_ids, options)
        with serving.state.track():
            async with aclosing(serving.generate(engine_request, detokenizer)) as deltas:
                async for delta in deltas:
                    yield generate_pb2.GenerateResponse(
                        request_id=response_id,
                        text=delta.text,
                        token_ids=delta.token_ids,
                        finish_reason=int(_FINISH_REASONS.get(delta.finish_reason, FinishReason.NONE)),
                        num_prompt_tokens=len(prompt_token_ids),
                        num_completion_tokens=len(detokenizer.output_token_ids),
                        num_cached_tokens=delta.num_cached_tokens,
                    )


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
        priority=request.priority,
    )


def _describe(err: APIError) -> str:
    return f"{err.message} (param: {err.param})" if err.param else err.message
