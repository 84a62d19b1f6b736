"""POST /v1/chat/completions: chat template, then one JSON response or a stream of chunks."""
from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web

from services.common.messages import EngineCoreRequest
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.protocol import ChatCompletionRequest, parse_chat_request, parse_json_body
from services.frontend.serving_engine import OpenAIServing, add_token_ids, usage_dict
from services.frontend.sse import write_sse
from services.frontend.tokenizer import render_chat_prompt


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, http_request: web.Request) -> web.StreamResponse:
        request = parse_chat_request(parse_json_body(await http_request.read()))
        self.check_model(request.options.model)
        self.check_ready()
        prompt_token_ids = render_chat_prompt(self.model.tokenizer, request.messages)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        engine_request = self.make_engine_request(request_id, prompt_token_ids, request.options, "messages")
        detokenizer = self.make_detokenizer(prompt_token_ids, request.options)
        with self.state.track():
            if request.options.is_stream:
                return await write_sse(http_request, self._stream_chunks(request, engine_request, detokenizer))
            response = await self._full_response(engine_request, detokenizer)
            if request.options.return_token_ids:
                add_token_ids(response, engine_request, detokenizer)
            return web.json_response(response)

    async def _full_response(self, engine_request: EngineCoreRequest, detokenizer: IncrementalDetokenizer) -> dict:
        texts, finish_reason, num_cached_tokens = [], None, 0
        async with aclosing(self.generate(engine_request, detokenizer)) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                finish_reason = delta.finish_reason or finish_reason
                num_cached_tokens = delta.num_cached_tokens
        return {
            "id": engine_request.request_id,
            "object": "chat.completion",
            "created": int(engine_request.arrival_time),
            "model": self.model.name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "".join(texts), "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }],
            "usage": usage_dict(len(engine_request.prompt_token_ids), len(detokenizer.output_token_ids),
                                num_cached_tokens),
        }

    async def _stream_chunks(
        self, request: ChatCompletionRequest, engine_request: EngineCoreRequest, detokenizer: IncrementalDetokenizer
    ) -> AsyncIterator[dict[str, Any]]:
        """Role chunk (sent once the engine produced something), content chunks, finish, usage."""
        created = int(engine_request.arrival_time)
        is_first = True
        num_cached_tokens = 0

        def chunk(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
            return {
                "id": engine_request.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            }

        async with aclosing(self.generate(engine_request, detokenizer)) as deltas:
            async for delta in deltas:
                if is_first:
                    yield chunk({"role": "assistant", "content": ""}, None)
                    is_first = False
                num_cached_tokens = delta.num_cached_tokens
                if delta.text or delta.finish_reason:
                    yield chunk({"content": delta.text} if delta.text else {}, delta.finish_reason)
        if request.options.include_usage:
            yield {
                "id": engine_request.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model.name,
                "choices": [],
                "usage": usage_dict(len(engine_request.prompt_token_ids), len(detokenizer.output_token_ids),
                                    num_cached_tokens),
            }
