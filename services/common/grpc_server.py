"""The one gRPC server skeleton every service uses.

grpc.aio, `grpc.health.v1` (NOT_SERVING until the service says it is ready, and again while it
drains), server reflection, message limits (large by default: a step's SchedulerOutput can be big),
service-to-service authentication when configured (mutual TLS and/or a token, health exempt:
services/common/service_auth.py), and stop with a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth_interceptor import ServiceAuthInterceptor
from services.common.service_auth import NO_SERVICE_AUTH, ServiceAuthConfig, server_credentials

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def server_options(max_receive_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
    ]


class GrpcServer:
    """A grpc.aio server with health checking and reflection for the given service names.

    `auth`: who may call (services/common/service_auth.py); with TLS configured the port is TLS
    with a required client certificate, and every call but health is checked. `interceptors`: the
    tracing interceptor when tracing is on (services/common/telemetry.py); they run after the auth
    check. `max_receive_message_bytes`: the largest request message accepted.
    """

    def __init__(self, address: str, service_names: list[str], interceptors: Sequence[Any] = (),
                 auth: ServiceAuthConfig = NO_SERVICE_AUTH, max_receive_message_bytes: int = MAX_MESSAGE_BYTES):
        self.address = address
        self.auth = auth
        guards = [ServiceAuthInterceptor(auth)] if auth.is_server_auth_enforced else []
        self.server = grpc.aio.server(options=server_options(max_receive_message_bytes),
                                      interceptors=[*guards, *interceptors])
        self._service_names = list(service_names)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        reflection.enable_server_reflection(
            self._service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.port = 0

    async def start(self) -> None:
        if self.auth.is_tls:
            self.port = self.server.add_secure_port(self.address, server_credentials(self.auth))
        else:
            self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"cannot bind gRPC server to {self.address}")
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, is_serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            await self._health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


def install_stop_signals(stop: asyncio.Event, on_signal: Callable[[int], None] | None = None) -> None:
    """SIGTERM and SIGINT set `stop` (a second signal is left to the default handler's force)."""
    loop = asyncio.get_running_loop()

    def handle(signum: int) -> None:
        logger.info("received %s: draining", signal.Signals(signum).name)
        if on_signal is not None:
            on_signal(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)
