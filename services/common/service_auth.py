"""Service-to-service authentication: who may call the scheduler and the worker.

Two mechanisms, each enforced when configured (both at once when both are):

- Mutual TLS (`--tls-cert`, `--tls-key`, `--tls-ca`): a server requires a client certificate signed
  by the CA, and a client presents its own and verifies the server's against the same CA and the
  dialled host name. The server then checks the caller's identity (a SAN DNS name or the subject
  CN) against `--tls-allowed-clients`: the scheduler admits frontends, the worker its scheduler.
- A shared secret in gRPC metadata (`authorization: Bearer <token>`). A token is named after the
  server it opens: `--scheduler-token` (or `--scheduler-token-file`) is what the scheduler accepts
  and what a frontend sends; `--worker-token` is what the worker accepts and what the scheduler
  sends. A frontend holds no worker token, so its credential does not open the worker.

Neither is on by default (`make run` on loopback). `grpc.health.v1.Health` is exempt on every
server so probes need no credential (services/common/auth_interceptor.py enforces the rest).
Tokens never appear in a repr, a log line or an error message.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grpc

from services.common.bearer import AUTHORIZATION_KEY
from services.common.flags import add_flag

# Below this a token is guessable; `openssl rand -hex 32` gives 64 characters.
MIN_TOKEN_CHARS = 16
BEARER_PREFIX = "Bearer "
# Default identities, the Kubernetes Service names the certificates carry (k8s/cert-manager/).
FRONTEND_IDENTITY = "spindle-frontend"
SCHEDULER_IDENTITY = "spindle-scheduler"


@dataclass(frozen=True)
class ServiceAuthConfig:
    """One service's credentials: what its server demands and what its client presents."""

    tls_cert_path: str | None = None  # PEM certificate chain of this service
    tls_key_path: str | None = None  # PEM private key of that certificate
    tls_ca_path: str | None = None  # PEM CA that signs every peer's certificate
    # Certificate identities this service's server admits (used with TLS only).
    allowed_client_names: tuple[str, ...] = ()
    server_token: str | None = field(default=None, repr=False)  # the token this server accepts
    client_token: str | None = field(default=None, repr=False)  # the token sent to the service called

    def __post_init__(self) -> None:
        paths = (self.tls_cert_path, self.tls_key_path, self.tls_ca_path)
        if any(paths) and not all(paths):
            raise ValueError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
        for name, token in (("the accepted token", self.server_token), ("the sent token", self.client_token)):
            if token is not None:
                check_token(token, name)

    @property
    def is_tls(self) -> bool:
        return self.tls_cert_path is not None

    @property
    def is_server_auth_enforced(self) -> bool:
        """True when this service's server refuses unauthenticated callers."""
        return self.is_tls or self.server_token is not None


NO_SERVICE_AUTH = ServiceAuthConfig()


def check_token(token: str, label: str) -> None:
    """Raises ValueError (naming `label`, never the token) for a guessable or malformed token."""
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"{label} must be at least {MIN_TOKEN_CHARS} characters without whitespace "
                         "(e.g. `openssl rand -hex 32`)")


def add_service_auth_flags(parser: argparse.ArgumentParser, *, accepts_token_of: str | None = None,
                           sends_token_to: str | None = None, default_allowed_clients: str = "") -> None:
    """Adds the TLS flags and the token flags of a service that serves as `accepts_token_of`
    (scheduler, worker; None for a client only) and calls `sends_token_to` (None: calls no one).
    `service_auth_config_from_args` then builds the config from the parsed arguments."""
    add_flag(parser, "--tls-cert", help="PEM certificate (chain) of this service, for mutual TLS between services")
    add_flag(parser, "--tls-key", help="PEM private key of --tls-cert")
    add_flag(parser, "--tls-ca", help="PEM CA certificate that signs every service's certificate")
    if accepts_token_of is not None:
        add_flag(parser, "--tls-allowed-clients", default=default_allowed_clients,
                 help="comma-separated certificate identities (SAN DNS name or CN) this server admits "
                      f"under mutual TLS (default: {default_allowed_clients or 'none'})")
    for service in dict.fromkeys(s for s in (accepts_token_of, sends_token_to) if s is not None):
        role = ("accepted by this service" if service == accepts_token_of else f"sent to the {service}")
        add_flag(parser, f"--{service}-token",
                 help=f"shared secret {role} in gRPC metadata; prefer the environment variable or "
                      f"--{service}-token-file (a command line is visible to other local users)")
        add_flag(parser, f"--{service}-token-file", help=f"file holding the --{service}-token secret")
    parser.set_defaults(service_auth_roles=(accepts_token_of, sends_token_to))


def service_auth_config_from_args(args: argparse.Namespace) -> ServiceAuthConfig:
    """The config of the flags `add_service_auth_flags` added; reads token files (a missing file
    is a start-up error). Empty values count as unset, as for every other flag."""
    accepts, sends = args.service_auth_roles
    options = vars(args)
    allowed = tuple(name.strip() for name in (options.get("tls_allowed_clients") or "").split(",") if name.strip())
    config = ServiceAuthConfig(
        tls_cert_path=args.tls_cert or None,
        tls_key_path=args.tls_key or None,
        tls_ca_path=args.tls_ca or None,
        allowed_client_names=allowed,
        server_token=_token(options, accepts),
        client_token=_token(options, sends),
    )
    if accepts is not None and config.is_tls and not allowed:
        raise ValueError("--tls-allowed-clients is empty: under mutual TLS this server would admit no one")
    return config


def _token(options: dict[str, Any], service: str | None) -> str | None:
    if service is None:
        return None
    value, path = options[f"{service}_token"] or None, options[f"{service}_token_file"] or None
    if value is not None and path is not None:
        raise ValueError(f"set one of --{service}-token and --{service}-token-file, not both")
    if path is not None:
        try:
            value = Path(path).read_text().strip() or None
        except OSError as exc:
            raise ValueError(f"--{service}-token-file: cannot read {path}: {exc.strerror}") from None
        if value is None:
            raise ValueError(f"--{service}-token-file: {path} is empty")
    if value is not None:
        check_token(value, f"--{service}-token")
    return value


# --- credentials -------------------------------------------------------------------------------------
def read_pem_files(config: ServiceAuthConfig) -> tuple[bytes, bytes, bytes]:
    """(certificate chain, private key, CA) as bytes; a missing file names the flag."""
    found = []
    for flag, path in (("--tls-cert", config.tls_cert_path), ("--tls-key", config.tls_key_path),
                       ("--tls-ca", config.tls_ca_path)):
        try:
            found.append(Path(path).read_bytes())
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    return found[0], found[1], found[2]


def server_credentials(config: ServiceAuthConfig) -> grpc.ServerCredentials:
    """TLS that requires a client certificate signed by the CA. The files are read again on each
    new connection's handshake, so a certificate renewed in place (a cert-manager Secret mounted
    as a volume) is served without a restart."""
    initial = read_pem_files(config)
    current = [initial]

    def configuration(files: tuple[bytes, bytes, bytes]) -> Any:
        cert, key, ca = files
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> Any:
        try:
            files = read_pem_files(config)
        except ValueError:
            return None  # mid-rotation: keep serving the last good files
        if files == current[0]:
            return None
        current[0] = files
        return configuration(files)

    return grpc.dynamic_ssl_server_credentials(configuration(initial), fetch, require_client_authentication=True)


def channel_credentials(config: ServiceAuthConfig) -> grpc.ChannelCredentials:
    """This service's certificate for the server to check, and the CA to check the server's with."""
    cert, key, ca = read_pem_files(config)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def open_channel(address: str, config: ServiceAuthConfig, options: Sequence[tuple[str, Any]],
                 interceptors: Sequence[Any] = ()) -> grpc.aio.Channel:
    """A channel to an internal service: TLS with this service's certificate when configured, and
    the token in every call's metadata when one is set (after `interceptors`, e.g. tracing)."""
    interceptors = [*interceptors, *token_interceptors(config.client_token)]
    if config.is_tls:
        return grpc.aio.secure_channel(address, channel_credentials(config), options=list(options),
                                       interceptors=interceptors or None)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors or None)


# --- the token on outgoing calls ---------------------------------------------------------------------
class _TokenMetadata:
    """Adds `authorization: Bearer <token>` to a call's metadata."""

    def __init__(self, token: str):
        self._entry = (AUTHORIZATION_KEY, BEARER_PREFIX + token)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"  # never the token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files an interceptor under the first call kind it implements, so each kind has its own.
class _UnaryUnaryToken(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamToken(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(token: str | None) -> list[Any]:
    """Client interceptors that send `token` on calls of all four kinds; none when no token is set."""
    if token is None:
        return []
    return [kind(token) for kind in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)]
