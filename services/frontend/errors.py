"""Errors the frontend shows to clients, as OpenAI error objects, and the engine's errors.

Every failure a client can see is an `APIError`: an HTTP status plus the OpenAI body
`{"error": {"message", "type", "param", "code"}}`. The gRPC service maps the same errors to status
codes, so both faces refuse the same inputs the same way.
"""
from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any, Awaitable, Callable

from aiohttp import web

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a refused request.
RETRY_AFTER_BUSY_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5


class EngineError(Exception):
    """The engine refused a request or died while running it.

    `code` is one of 'unavailable', 'resource_exhausted', 'invalid_argument', 'internal'.
    """

    CODES = ("unavailable", "resource_exhausted", "invalid_argument", "internal")

    def __init__(self, message: str, code: str = "internal"):
        super().__init__(message)
        self.message = message
        self.code = code if code in self.CODES else "internal"


class APIError(Exception):
    """An error with the HTTP status and OpenAI error object a client receives."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


def route_not_found(method: str, path: str) -> APIError:
    return APIError(404, f"Invalid URL ({method} {path})", "invalid_request_error", code="not_found")


def service_unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable",
                    retry_after_s=RETRY_AFTER_UNAVAILABLE_S)


def internal_error(message: str) -> APIError:
    return APIError(500, message, "server_error", code="internal_error")


def from_engine_error(exc: EngineError) -> APIError:
    if exc.code == "resource_exhausted":
        return APIError(429, exc.message, "rate_limit_error", code="rate_limit_exceeded",
                        retry_after_s=RETRY_AFTER_BUSY_S)
    if exc.code == "unavailable":
        return service_unavailable(exc.message)
    if exc.code == "invalid_argument":
        return invalid_request(exc.message)
    return internal_error(exc.message)


def from_http_exception(exc: web.HTTPException, request: web.Request) -> APIError:
    """aiohttp's own refusals (unknown route, wrong method, body too large) as OpenAI errors."""
    if exc.status == 404:
        return route_not_found(request.method, request.path)
    type_ = "invalid_request_error" if exc.status < 500 else "server_error"
    return APIError(exc.status, exc.text or HTTPStatus(exc.status).phrase, type_,
                    code=HTTPStatus(exc.status).phrase.lower().replace(" ", "_"))


def error_response(err: APIError) -> web.Response:
    return web.json_response(err.to_dict(), status=err.status, headers=err.headers())


def sse_error_event(err: APIError) -> bytes:
    """The one `data:` line that reports an error after a stream has started."""
    return b"data: " + json.dumps(err.to_dict()).encode() + b"\n\n"


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turns every exception into a JSON error response so a bad request never crashes the server."""
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except EngineError as exc:
        return error_response(from_engine_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like pass through untouched
            raise
        return error_response(from_http_exception(exc, request))
    except (ConnectionResetError, ConnectionError):
        raise  # the client went away; nobody is left to read a response
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(internal_error("internal server error"))
