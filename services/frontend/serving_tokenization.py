"""POST /tokenize and POST /detokenize (vLLM's shapes): the served model's tokenizer as a service.

/tokenize takes `prompt` (a string; `add_special_tokens` defaults to true, as /v1/completions
encodes it) or chat `messages` (rendered with the chat template as /v1/chat/completions does) and
returns `{count, max_model_len, tokens}` plus `token_strs` if `return_token_strs` is true.
/detokenize takes `tokens` (ids) and returns `{prompt}`.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from services.frontend.errors import invalid_request
from services.frontend.json_body import parse_json_body
from services.frontend.protocol import parse_chat_request
from services.frontend.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def create_tokenize(self, http_request: web.Request) -> web.Response:
        body = parse_json_body(await http_request.read())
        self.check_model(_model(body))
        await self.wait_ready()  # max_model_len comes from the engine
        if "messages" in body:
            chat = parse_chat_request({"messages": body["messages"], "tools": body.get("tools")})
            tools = chat.tool_choice.tools if chat.tool_choice is not None else None
            token_ids = await self.async_tokenizer.render_chat_prompt(chat.messages, list(tools) if tools else None)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise invalid_request("Give 'prompt' (a string) or 'messages'.", param="prompt")
            add_special_tokens = _flag(body, "add_special_tokens", True)
            token_ids = await self.async_tokenizer.encode_prompt(prompt, add_special_tokens=add_special_tokens)
        response: dict[str, Any] = {"count": len(token_ids), "max_model_len": self.max_model_len,
                                    "tokens": token_ids}
        if _flag(body, "return_token_strs", False):
            response["token_strs"] = await self.async_tokenizer.convert_ids_to_tokens(token_ids)
        return web.json_response(response)

    async def create_detokenize(self, http_request: web.Request) -> web.Response:
        body = parse_json_body(await http_request.read())
        self.check_model(_model(body))
        await self.wait_ready()
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise invalid_request("'tokens' must be an array of token ids.", param="tokens")
        self._check_token_ids(tokens, "tokens")
        return web.json_response({"prompt": await self.async_tokenizer.decode(tokens)})


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_request("'model' must be a string.", param="model")
    return model


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"'{name}' must be a boolean.", param=name)
    return value
