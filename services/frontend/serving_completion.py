"""POST /v1/completions: a text or token-id prompt, then one JSON response or a stream of chunks.

Streamed and full responses share one shape (`text_completion`); streamed chunks carry
`finish_reason: null` until the last one, as OpenAI's API does.
"""
from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web

from services.common.messages import EngineCoreRequest
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.protocol import CompletionRequest, parse_completion_request, parse_json_body
from services.frontend.serving_engine import OpenAIServing, add_token_ids, usage_dict
from services.frontend.sse import write_sse
from services.frontend.tokenizer import encode_prompt

# OpenAI's default for /v1/completions (chat defaults to whatever fits in the context).
DEFAULT_MAX_TOKENS = 16


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, http_request: web.Request) -> web.StreamResponse:
        request = parse_completion_request(parse_json_body(await http_request.read()))
        self.check_model(request.options.model)
        self.check_ready()
        if isinstance(request.prompt, str):
            prompt_token_ids = encode_prompt(self.model.tokenizer, request.prompt)
        else:
            prompt_token_ids = request.prompt
        request_id = f"cmpl-{uuid.uuid4().hex}"
        engine_request = self.make_engine_request(
            request_id, prompt_token_ids, request.options, "prompt", default_max_tokens=DEFAULT_MAX_TOKENS
        )
        detokenizer = self.make_detokenizer(prompt_token_ids, request.options)
        with self.state.track():
            if request.options.is_stream:
                return await write_sse(http_request, self._stream_chunks(request, engine_request, detokenizer))
            response = await self._full_response(engine_request, detokenizer)
            if request.options.return_token_ids:
                add_token_ids(response, engine_request, detokenizer)
            return web.json_response(response)

    def _response(self, engine_request: EngineCoreRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": engine_request.request_id,
            "object": "text_completion",
            "created": int(engine_request.arrival_time),
            "model": self.model.name,
            "choices": choices,
        }

    async def _full_response(self, engine_request: EngineCoreRequest, detokenizer: IncrementalDetokenizer) -> dict:
        texts, finish_reason, num_cached_tokens = [], None, 0
        async with aclosing(self.generate(engine_request, detokenizer)) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                finish_reason = delta.finish_reason or finish_reason
                num_cached_tokens = delta.num_cached_tokens
        response = self._response(
            engine_request, [{"index": 0, "text": "".join(texts), "logprobs": None, "finish_reason": finish_reason}]
        )
        response["usage"] = usage_dict(
            len(engine_request.prompt_token_ids), len(detokenizer.output_token_ids), num_cached_tokens
        )
        return response

    async def _stream_chunks(
        self, request: CompletionRequest, engine_request: EngineCoreRequest, detokenizer: IncrementalDetokenizer
    ) -> AsyncIterator[dict[str, Any]]:
        num_cached_tokens = 0
        async with aclosing(self.generate(engine_request, detokenizer)) as deltas:
            async for delta in deltas:
                num_cached_tokens = delta.num_cached_tokens
                if delta.text or delta.finish_reason:
                    yield self._response(engine_request, [
                        {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
                    ])
        if request.options.include_usage:
            usage_chunk = self._response(engine_request, [])
            usage_chunk["usage"] = usage_dict(
                len(engine_request.prompt_token_ids), len(detokenizer.output_token_ids), num_cached_tokens
            )
            yield usage_chunk
