"""POST /v1/chat/completions: chat template, then one JSON response or a stream of chunks.

`n` choices run as n engine requests at once; a stream interleaves their chunks, each tagged with
its choice's `index`. With `logprobs: true`, every chunk (or the full choice) carries the logprobs
of the tokens it covers. With tools, each choice's text is read for tool calls (tool_outputs.py):
`message.tool_calls` in a full response, `delta.tool_calls` pieces in a stream.
"""
from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web

from services.frontend.logprobs import chat_logprobs_content
from services.frontend.json_body import parse_json_body
from services.frontend.protocol import ChatCompletionRequest, parse_chat_request
from services.frontend.serving_engine import Choice, OpenAIServing, TextDelta, add_token_ids, choices_usage
from services.frontend.sse import write_sse
from services.frontend.tool_outputs import ChoiceToolOutput, finish_reason_with_tools


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, http_request: web.Request) -> web.StreamResponse:
        request = parse_chat_request(parse_json_body(await http_request.read()), self.model.generation_defaults)
        self.check_model(request.options.model)
        await self.wait_ready()
        await self.check_constraint(request.options)
        tool_choice = request.tool_choice
        tools = list(tool_choice.tools) if tool_choice is not None and tool_choice.renders_tools else None
        prompt_token_ids = await self.async_tokenizer.render_chat_prompt(request.messages, tools)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = self.make_choices(request_id, prompt_token_ids, request.options, "messages")
        with self.state.track():
            if request.options.is_stream:
                return await write_sse(http_request, self._stream_chunks(request, request_id, choices))
            response = await self._full_response(request, request_id, choices)
            if request.options.return_token_ids:
                add_token_ids(response, choices)
            return web.json_response(response)

    def _logprobs(self, request: ChatCompletionRequest, delta: TextDelta) -> dict[str, Any] | None:
        if request.options.sampling_params.logprobs is None:
            return None
        return {"content": chat_logprobs_content(self.token_strings, delta.token_ids, delta.logprobs),
                "refusal": None}

    async def _full_response(self, request: ChatCompletionRequest, request_id: str, choices: list[Choice]) -> dict:
        texts: list[list[str]] = [[] for _ in choices]
        logprobs: list[list[dict]] = [[] for _ in choices]
        async with aclosing(self.generate_choices(choices, final_only=True)) as deltas:
            async for index, delta in deltas:
                texts[index].append(delta.text)
                part = self._logprobs(request, delta)
                if part is not None:
                    logprobs[index].extend(part["content"])
        wants_logprobs = request.options.sampling_params.logprobs is not None
        out = []
        for i, choice in enumerate(choices):
            tools = ChoiceToolOutput(request.tool_choice, self.model.tool_call_parser)
            message, finish_reason = tools.message("".join(texts[i]), choice.finish_reason)
            out.append({"index": i, "message": message, "finish_reason": finish_reason,
                        "logprobs": {"content": logprobs[i], "refusal": None} if wants_logprobs else None})
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(choices[0].engine_request.arrival_time),
            "model": self.model.name,
            "choices": out,
            "usage": choices_usage(choices),
        }

    async def _stream_chunks(
        self, request: ChatCompletionRequest, request_id: str, choices: list[Choice]
    ) -> AsyncIterator[dict[str, Any]]:
        """Per choice: a role chunk (once the engine produced something), content chunks, the finish;
        then, if asked, one usage chunk for the whole request."""
        created = int(choices[0].engine_request.arrival_time)
        has_started = [False] * len(choices)
        tools = [ChoiceToolOutput(request.tool_choice, self.model.tool_call_parser) for _ in choices]

        def chunk(index: int, delta: dict[str, Any], finish_reason: str | None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model.name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
            }

        async with aclosing(self.generate_choices(choices)) as deltas:
            async for index, delta in deltas:
                if not has_started[index]:
                    yield chunk(index, {"role": "assistant", "content": ""}, None)
                    has_started[index] = True
                logprobs = self._logprobs(request, delta)
                is_last = delta.finish_reason is not None
                pieces = tools[index].feed(delta.text, is_last)
                finish_reason = finish_reason_with_tools(delta.finish_reason, tools[index].has_called_tools)
                if not pieces and (is_last or (logprobs and logprobs["content"])):
                    pieces = [{}]
                for j, piece in enumerate(pieces):  # logprobs ride on the first, the finish on the last
                    yield chunk(index, piece, finish_reason if j == len(pieces) - 1 else None,
                                logprobs if j == 0 else None)
        if request.options.include_usage:
            yield {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model.name,
                "choices": [],
                "usage": choices_usage(choices),
            }
