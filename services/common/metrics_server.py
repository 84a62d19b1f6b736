"""A Prometheus `/metrics` endpoint for the gRPC-only services (scheduler, worker).

It runs on the service's own asyncio loop (aiohttp) rather than prometheus_client's HTTP thread:
collectors then read engine state from the thread that changes it, with no locks, and a scrape
costs the busy loop one short callback every 15 s. The frontend serves the same text on its HTTP
port instead (services/frontend/metrics.py).
"""
from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

logger = logging.getLogger(__name__)


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """Prometheus text format 0.0.4 for everything in `registry`: our names are all legacy-valid, and
    0.0.4 is what every scraper reads (Prometheus 2.x, the Inference Extension's endpoint picker)."""
    response = web.Response(body=generate_latest(registry))
    response.headers["Content-Type"] = CONTENT_TYPE_PLAIN_0_0_4
    return response


class MetricsServer:
    """GET /metrics on host:port; `start()` then `stop()`. Port 0 means "no metrics port"."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry = registry
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        if self.port == 0:
            return
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as exc:
            # A busy metrics port must not take the engine down with it: serve without metrics.
            logger.error("cannot serve metrics on %s:%d (%s); continuing without a metrics port",
                         self.host, self.port, exc)
            await self._runner.cleanup()
            self._runner = None
            return
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        return metrics_response(self.registry)


def listen_host(grpc_addr: str) -> str:
    """The metrics port listens where the service's gRPC port does (0.0.0.0 in a pod, loopback locally)."""
    return grpc_addr.rsplit(":", 1)[0] or "0.0.0.0"
