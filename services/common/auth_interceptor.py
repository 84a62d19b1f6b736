"""The server side of service authentication (services/common/service_auth.py): one grpc.aio
interceptor checks every call except `grpc.health.v1.Health/*`, which probes must reach without a
credential.

grpc.aio's `intercept_service` sees the method and metadata but no peer certificate, so the check
runs inside the handler, at call time, where the ServicerContext gives both. A refused call ends
with UNAUTHENTICATED (no or wrong token, no certificate identity) or PERMISSION_DENIED (a valid
certificate whose identity this server does not admit) before the service's code runs.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

import grpc

from services.common.bearer import GRPC_HEALTH_PREFIX, digests_equal, metadata_authorization, parse_bearer, token_digest
from services.common.service_auth import ServiceAuthConfig

logger = logging.getLogger(__name__)

EXEMPT_METHOD_PREFIX = GRPC_HEALTH_PREFIX
# Where gRPC's auth context puts a verified peer certificate's SAN DNS names and subject CN (IP
# and URI SANs are not identities here). Neither present: no identity, the call is refused.
IDENTITY_PROPERTIES = ("peer_dns", "x509_common_name")

Refusal = tuple[grpc.StatusCode, str]


def check_call(config: ServiceAuthConfig, metadata: Iterable[tuple[str, Any]] | None,
               auth_context: Mapping[str, Sequence[bytes]] | None) -> Refusal | None:
    """None when the caller may proceed; else the status and message to refuse the call with.
    Under TLS the handshake has already verified the certificate; this checks whose it is."""
    if config.is_tls:
        names = peer_identities(auth_context or {})
        if not names:
            return grpc.StatusCode.UNAUTHENTICATED, "no client certificate identity"
        if not names & set(config.allowed_client_names):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"certificate identity {', '.join(sorted(names))} may not call this service")
    if config.server_token is not None:
        presented = bearer_token(metadata or ())
        if presented is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing service token (authorization: Bearer ...)"
        if not tokens_equal(presented, config.server_token):
            return grpc.StatusCode.UNAUTHENTICATED, "invalid service token"
    return None


def tokens_equal(presented: str, expected: str) -> bool:
    """Constant time, and the digests hide even the expected token's length."""
    return digests_equal(token_digest(presented), token_digest(expected))


def bearer_token(metadata: Iterable[tuple[str, Any]]) -> str | None:
    """The token of the first `authorization` entry if it is `Bearer <token>` (scheme in any case)."""
    return parse_bearer(metadata_authorization(metadata))


def peer_identities(auth_context: Mapping[str, Sequence[bytes]]) -> set[str]:
    """The verified peer certificate's SAN DNS names and subject CN."""
    return {value.decode("utf-8", "replace") for prop in IDENTITY_PROPERTIES for value in auth_context.get(prop, ())}


class ServiceAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health that fails `check_call` for this server's config."""

    def __init__(self, config: ServiceAuthConfig):
        self.config = config

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        if handler is None or method.startswith(EXEMPT_METHOD_PREFIX):
            return handler
        return guard_handler(handler, lambda context: self._enforce(method, context))

    async def _enforce(self, method: str, context: grpc.aio.ServicerContext) -> None:
        refusal = check_call(self.config, context.invocation_metadata(), context.auth_context())
        if refusal is not None:
            code, details = refusal
            logger.warning("refused %s from %s: %s %s", method, context.peer(), code.name, details)
            await context.abort(code, details)


Enforce = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


def guard_handler(handler: grpc.RpcMethodHandler, enforce: Enforce) -> grpc.RpcMethodHandler:
    """The same handler, with `enforce(context)` awaited before its behaviour runs (any kind)."""
    serializers = dict(request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, enforce), **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, enforce), **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, enforce), **serializers)
    return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, enforce), **serializers)


def _unary(behaviour: Callable, enforce: Enforce) -> Callable:
    async def guarded(request_or_iterator, context):
        await enforce(context)
        result = behaviour(request_or_iterator, context)
        return await result if inspect.isawaitable(result) else result

    return guarded


def _streaming(behaviour: Callable, enforce: Enforce) -> Callable:
    # grpc.aio tells a handler that writes through `context.write` (a coroutine function) from one
    # that yields its responses (an async generator) by its type: the wrapper keeps the type.
    if inspect.iscoroutinefunction(behaviour):
        async def guarded_writer(request_or_iterator, context):
            await enforce(context)
            return await behaviour(request_or_iterator, context)

        return guarded_writer

    async def guarded(request_or_iterator, context):
        await enforce(context)
        responses = behaviour(request_or_iterator, context)
        if inspect.isasyncgen(responses):
            async for response in responses:
                yield response
        else:
            for response in responses:
                yield response

    return guarded
