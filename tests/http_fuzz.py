"""Sends fuzzed request bodies to the frontend's HTTP API and checks each reply against its contract.

    with fuzz_target(app=create_app(...)) as target:      # in-process, or base_url= a running frontend
        check_reply(body, target.post(body))

The contract, for every body however broken: an answer within `PER_REQUEST_TIMEOUT_S` (a hang is a
failure), never a 5xx, every refusal an OpenAI error object (`ErrorResponse`, with a message), every
200 valid against the official response schema (a stream: `data:` events of valid chunks, then
`data: [DONE]`, and no error event), as many choices as asked for, each with one finish reason, no
more tokens than `max_tokens` allows, and usage that adds up.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, Iterator

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from tests.openai_schema import COMPLETION_CHUNK, validate, validate_sse
from tests.openapi_strategies import CHAT, COMPLETIONS, DETOKENIZE, TOKENIZE, Body

# Generous: a reply takes milliseconds from the fake engine, under a second from a tiny model.
PER_REQUEST_TIMEOUT_S = 60.0
_SCHEMAS = {CHAT: ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse"),
            COMPLETIONS: ("CreateCompletionResponse", COMPLETION_CHUNK)}


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.raw)

    def __repr__(self) -> str:
        shown = self.raw if len(self.raw) <= 1500 else self.raw[:1500] + b"..."
        return f"Reply({self.status}, {self.content_type}, {shown!r})"


class FuzzTarget:
    """A frontend's base URL and a private event loop that sends one body at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession, base_url: str):
        self.loop, self.session, self.base_url = loop, session, base_url

    def post(self, body: Body) -> Reply:
        """Sends `body` and reads the whole reply; AssertionError if none comes within the timeout."""
        return self.request("POST", body.path, body.raw, what=repr(body))

    def request(self, method: str, path: str, data: bytes = b"", what: str = "") -> Reply:
        try:
            return self.loop.run_until_complete(asyncio.wait_for(self._request(method, path, data),
                                                                 PER_REQUEST_TIMEOUT_S))
        except asyncio.TimeoutError:
            raise AssertionError(f"no complete reply within {PER_REQUEST_TIMEOUT_S} s to "
                                 f"{what or method + ' ' + path}") from None

    async def _request(self, method: str, path: str, data: bytes) -> Reply:
        headers = {"Content-Type": "application/json"} if data else {}
        url = URL(self.base_url + path, encoded=True)  # sent as given: fuzzed paths are percent-encoded
        async with self.session.request(method, url, data=data, headers=headers) as response:
            return Reply(response.status, response.content_type, await response.read())


@contextlib.contextmanager
def fuzz_target(app: web.Application | None = None, base_url: str | None = None) -> Iterator[FuzzTarget]:
    """A target for `app` served in-process on a free port, or for a frontend already at `base_url`."""
    loop = asyncio.new_event_loop()
    server = TestServer(app) if app is not None else None
    try:
        if server is not None:
            loop.run_until_complete(server.start_server())
            base_url = str(server.make_url("")).rstrip("/")
        session = loop.run_until_complete(_new_session())
        try:
            yield FuzzTarget(loop, session, base_url)
        finally:
            loop.run_until_complete(session.close())
    finally:
        if server is not None:
            loop.run_until_complete(server.close())
        loop.close()


async def _new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))


def check_reply(body: Body, reply: Reply) -> None:
    """Asserts the contract of the module's docstring for one body and its reply."""
    where = f"{body!r}\n -> {reply!r}"
    assert reply.status < 500, f"server error: {where}"
    if reply.status != 200:
        assert reply.content_type == "application/json", where
        payload = json.loads(reply.raw)
        validate(payload, "ErrorResponse")
        assert payload["error"]["message"], where
        return
    request = body.parsed()
    assert isinstance(request, dict), f"a body that is not a JSON object was served: {where}"
    if body.path in _SCHEMAS:
        _check_generation(body.path, request, reply, where)
    elif body.path == TOKENIZE:
        payload = json.loads(reply.raw)
        assert payload["count"] == len(payload["tokens"]) and isinstance(payload["max_model_len"], int), where
        assert all(isinstance(t, int) for t in payload["tokens"]), where
        if request.get("return_token_strs"):
            assert len(payload["token_strs"]) == payload["count"], where
    elif body.path == DETOKENIZE:
        payload = json.loads(reply.raw)
        assert list(payload) == ["prompt"] and isinstance(payload["prompt"], str), where


def _check_generation(path: str, request: dict[str, Any], reply: Reply, where: str) -> None:
    full_schema, chunk_schema = _SCHEMAS[path]
    n = request.get("n") or 1
    max_tokens = request.get("max_tokens")
    if path == CHAT and request.get("max_completion_tokens") is not None:
        max_tokens = request["max_completion_tokens"]  # chat's newer name wins
    if request.get("stream") is True:
        assert reply.content_type == "text/event-stream", where
        chunks = validate_sse(reply.raw.decode().split("\n"), chunk_schema)
        assert not any("error" in c for c in chunks), f"the stream failed: {where}"
        choices = [choice for c in chunks for choice in c["choices"]]
        finished = sorted(choice["index"] for choice in choices if choice["finish_reason"] is not None)
        assert finished == list(range(n)), f"not one finish per choice: {where}"
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usage) == bool((request.get("stream_options") or {}).get("include_usage")), where
    else:
        assert reply.content_type == "application/json", where
        response = json.loads(reply.raw)
        validate(response, full_schema)
        assert [c["index"] for c in response["choices"]] == list(range(n)), where
        assert all(c["finish_reason"] in ("stop", "length") for c in response["choices"]), where
        usage = [response["usage"]]
    for u in usage:
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], where
        assert max_tokens is None or u["completion_tokens"] <= n * max_tokens, where
