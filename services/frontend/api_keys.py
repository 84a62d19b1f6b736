"""API keys on both public faces: `Authorization: Bearer KEY` on HTTP, `authorization: Bearer KEY`
in gRPC metadata.

HTTP: every route but /health (probes) and, unless --protect-metrics, /metrics needs a key, unknown
routes included (no route list for anonymous clients); a refusal is 401 with an OpenAI error object
and `WWW-Authenticate: Bearer`. gRPC: every call but `grpc.health.v1.Health` needs one, reflection
included; a refusal is UNAUTHENTICATED.

A caller's identity scopes what it may touch (the gRPC Abort): `api-key-<i>` for the i-th key when
keys are on (never the key, nor anything derived from it), otherwise the caller's connection.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import grpc
from aiohttp import web

from services.common.bearer import GRPC_HEALTH_PREFIX, digests_equal, metadata_authorization, token_digest
from services.common.bearer import parse_bearer as bearer_token
from services.frontend.errors import APIError, error_response

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MISSING_KEY = "Missing API key: send it as 'Authorization: Bearer YOUR_KEY'."
WRONG_KEY = "Incorrect API key provided."


class ApiKeys:
    """The accepted keys; none means every caller is served."""

    def __init__(self, keys: Sequence[str] = ()):
        # Compared as SHA-256 digests: all one length, so the comparison's time tells nothing of a
        # key's length, and the keys themselves are not kept.
        self._digests = tuple(token_digest(key) for key in dict.fromkeys(keys))

    @property
    def is_enabled(self) -> bool:
        return bool(self._digests)

    def identity(self, authorization: str | bytes | None) -> str | None:
        """`api-key-<i>` when `authorization` is `Bearer <the i-th key>`, else None.

        Every key is compared, each in constant time, so the time taken does not say which matched.
        """
        token = bearer_token(authorization)
        if token is None:
            return None
        digest = token_digest(token)
        matched = None
        for i, key_digest in enumerate(self._digests):
            if digests_equal(digest, key_digest) and matched is None:
                matched = i
        return None if matched is None else f"api-key-{matched}"

    def refusal(self, authorization: str | bytes | None) -> str:
        """Why a request with this header is refused (never quoting what it sent)."""
        return MISSING_KEY if bearer_token(authorization) is None else WRONG_KEY


# --- HTTP ----------------------------------------------------------------------------------------
def api_key_middleware(keys: ApiKeys, protect_metrics: bool) -> Callable[..., Awaitable[web.StreamResponse]]:
    open_paths = {HEALTH_PATH} if protect_metrics else {HEALTH_PATH, METRICS_PATH}

    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        authorization = request.headers.get("Authorization")
        if keys.identity(authorization) is None:
            response = error_response(APIError(401, keys.refusal(authorization), "invalid_request_error",
                                               code="invalid_api_key"))
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    return middleware


# --- gRPC ----------------------------------------------------------------------------------------
def caller_identity(keys: ApiKeys, context: grpc.aio.ServicerContext) -> str:
    """Who is calling: its key's identity when keys are on, else its connection (`peer:<address>`)."""
    if keys.is_enabled:
        identity = keys.identity(metadata_authorization(context.invocation_metadata()))
        if identity is not None:
            return identity
    return f"peer:{context.peer()}"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid key with UNAUTHENTICATED, before its handler runs."""

    def __init__(self, keys: ApiKeys):
        self._keys = keys

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        authorization = metadata_authorization(handler_call_details.invocation_metadata)
        if (not self._keys.is_enabled or handler_call_details.method.startswith(GRPC_HEALTH_PREFIX)
                or self._keys.identity(authorization) is not None):
            return await continuation(handler_call_details)
        return _refusing_handler(await continuation(handler_call_details), self._keys.refusal(authorization))


def _refusing_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the call's own kind that answers UNAUTHENTICATED without reading the request."""
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is not None and handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler is not None and handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler is not None and handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
