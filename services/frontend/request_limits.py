"""The HTTP body limit, met before the body is read.

A `Content-Length` over the limit is refused at once, before a byte of the body is read; a chunked
(or compressed) body is read only until it passes the limit (aiohttp's `client_max_size`, set to the
same number, stops `request.read()` there). Either way the answer is 413 with an OpenAI error object
and `Connection: close`, since the rest of the body is not wanted.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from services.frontend.errors import APIError, error_response


def request_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {max_bytes} bytes.",
                    "invalid_request_error", code="request_too_large")


def body_limit_middleware(max_bytes: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > max_bytes:
            return _refuse(max_bytes)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # a body without Content-Length ran past the limit
            return _refuse(max_bytes)

    return middleware


def _refuse(max_bytes: int) -> web.Response:
    response = error_response(request_too_large(max_bytes))
    response.force_close()
    return response
