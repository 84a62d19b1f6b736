"""`Bearer <token>` credentials, as every gRPC server and the HTTP face read them: the one parser
and the one constant-time comparison the API keys (services/frontend/api_keys.py) and the service
tokens (services/common/auth_interceptor.py) share."""
from __future__ import annotations

import hashlib
import hmac
from typing import Any, Iterable

AUTHORIZATION_KEY = "authorization"
# Probes must reach gRPC health without a credential, on every server.
GRPC_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def parse_bearer(authorization: str | bytes | None) -> str | None:
    """The token of `Bearer <token>` (the scheme in any case, RFC 7235), else None."""
    if isinstance(authorization, bytes):
        authorization = authorization.decode("utf-8", "replace")
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def metadata_authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | bytes | None:
    """The value of the first `authorization` entry of gRPC metadata, if any."""
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION_KEY:
            return value
    return None


def token_digest(token: str) -> bytes:
    """SHA-256 of a token: compared digests are all one length, so a comparison's time says nothing
    of a token's length, and the tokens themselves need not be kept."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def digests_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
