"""POST /v1/completions: a text or token-id prompt, then one JSON response or a stream of chunks.

Streamed and full responses share one shape (`text_completion`); streamed chunks carry
`finish_reason: null` until the last one of their choice, as OpenAI's API does. `echo` puts the
prompt text before each choice's text (in a stream: in the choice's first chunk).
"""
from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web

from services.frontend.logprobs import CompletionLogprobs, merge_completion_logprobs
from services.frontend.json_body import parse_json_body
from services.frontend.protocol import CompletionRequest, parse_completion_request
from services.frontend.serving_engine import Choice, OpenAIServing, add_token_ids, choices_usage
from services.frontend.sse import write_sse

# OpenAI's default for /v1/completions (chat defaults to whatever fits in the context).
DEFAULT_MAX_TOKENS = 16


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, http_request: web.Request) -> web.StreamResponse:
        request = parse_completion_request(parse_json_body(await http_request.read()), self.model.generation_defaults)
        self.check_model(request.options.model)
        await self.wait_ready()
        await self.check_constraint(request.options)
        if isinstance(request.prompt, str):
            prompt_token_ids = await self.async_tokenizer.encode_prompt(request.prompt)
        else:
            prompt_token_ids = request.prompt
        request_id = f"cmpl-{uuid.uuid4().hex}"
        choices = self.make_choices(request_id, prompt_token_ids, request.options, "prompt",
                                    default_max_tokens=DEFAULT_MAX_TOKENS)
        with self.state.track():
            if request.options.is_stream:
                return await write_sse(http_request, self._stream_chunks(request, request_id, choices))
            response = await self._full_response(request, request_id, choices)
            if request.options.return_token_ids:
                add_token_ids(response, choices)
            return web.json_response(response)

    async def _echo_text(self, request: CompletionRequest) -> str:
        if not request.options.echo:
            return ""
        if isinstance(request.prompt, str):
            return request.prompt
        return await self.async_tokenizer.decode(request.prompt,
                                                 skip_special_tokens=request.options.skip_special_tokens)

    def _logprobs(self, request: CompletionRequest, n: int) -> list[CompletionLogprobs] | None:
        if request.options.sampling_params.logprobs is None:
            return None
        return [CompletionLogprobs(self.token_strings) for _ in range(n)]

    def _response(self, request_id: str, choices: list[Choice], out: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(choices[0].engine_request.arrival_time),
            "model": self.model.name,
            "choices": out,
        }

    async def _full_response(self, request: CompletionRequest, request_id: str, choices: list[Choice]) -> dict:
        echo = await self._echo_text(request)
        texts: list[list[str]] = [[echo] for _ in choices]
        logprobs = self._logprobs(request, len(choices))
        parts: list[list[dict]] = [[] for _ in choices]
        async with aclosing(self.generate_choices(choices, final_only=True)) as deltas:
            async for index, delta in deltas:
                texts[index].append(delta.text)
                if logprobs is not None:
                    parts[index].append(logprobs[index].take(delta.token_ids, delta.logprobs))
        response = self._response(request_id, choices, [{
            "index": i,
            "text": "".join(texts[i]),
            "logprobs": merge_completion_logprobs(parts[i]) if logprobs is not None else None,
            "finish_reason": choice.finish_reason,
        } for i, choice in enumerate(choices)])
        response["usage"] = choices_usage(choices)
        return response

    async def _stream_chunks(
        self, request: CompletionRequest, request_id: str, choices: list[Choice]
    ) -> AsyncIterator[dict[str, Any]]:
        echo = await self._echo_text(request)
        has_started = [False] * len(choices)
        logprobs = self._logprobs(request, len(choices))
        async with aclosing(self.generate_choices(choices)) as deltas:
            async for index, delta in deltas:
                text = delta.text
                if not has_started[index]:
                    text, has_started[index] = echo + text, True
                part = logprobs[index].take(delta.token_ids, delta.logprobs) if logprobs is not None else None
                if text or delta.finish_reason or (part and part["tokens"]):
                    yield self._response(request_id, choices, [
                        {"index": index, "text": text, "logprobs": part, "finish_reason": delta.finish_reason}
                    ])
        if request.options.include_usage:
            usage_chunk = self._response(request_id, choices, [])
            usage_chunk["usage"] = choices_usage(choices)
            yield usage_chunk
