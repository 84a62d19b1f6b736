"""Server-sent events for streamed completions: `data: {json}\\n\\n` per chunk, then `data: [DONE]`."""
from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web

from services.frontend.errors import APIError, EngineError, from_engine_error, internal_error, sse_error_event

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def encode_event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def write_sse(http_request: web.Request, chunks: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
    """Streams `chunks` to the client.

    The headers go out only with the first chunk, so a request the engine refuses at once still gets
    a plain HTTP error (429, 503, ...). An error after that is one `data:` event with the error
    object, followed by `data: [DONE]`. If the client disconnects, writing fails or the handler is
    cancelled, and closing `chunks` aborts the request in the engine.
    """
    async with aclosing(chunks) as events:
        first = await anext(events, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        try:
            await response.prepare(http_request)
            error = None
            try:
                if first is not None:
                    await response.write(encode_event(first))
                    async for chunk in events:
                        await response.write(encode_event(chunk))
            except APIError as err:
                error = err
            except EngineError as exc:
                logger.warning("request failed mid-stream: %s (%s)", exc.message, exc.code)
                error = from_engine_error(exc)
            except ConnectionError:
                raise
            except Exception:
                logger.exception("unhandled error mid-stream in %s", http_request.path)
                error = internal_error("internal server error")
            if error is not None:
                await response.write(sse_error_event(error))
            await response.write(DONE)
            await response.write_eof()
        except ConnectionError:
            # The client went away (leaving this block aborts its request); aiohttp ignores the rest.
            logger.debug("client disconnected from %s mid-stream", http_request.path)
        return response
