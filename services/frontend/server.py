"""Runs the frontend: the OpenAI HTTP API, the gRPC GenerateService and vLLM's engine gRPC protocol
(`VllmEngine`, its own gRPC server on --engine-grpc-port) in one asyncio loop.

Start-up: resolve the model folder, load the tokenizer, connect to the scheduler, listen on HTTP and
gRPC, log one ready line. SIGTERM/SIGINT: /health and gRPC health turn NOT_SERVING, new requests
get 503, in-flight requests may finish for up to --shutdown-timeout seconds, then everything stops
and the process exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from pathlib import Path

from aiohttp import web
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from services.common import event_loop
from services.common.grpc_server import GrpcServer, install_stop_signals
from services.common.logging_setup import setup_logging
from services.common.pb import generate_pb2_grpc
from services.common.telemetry import client_interceptors, server_interceptors, setup_tracing
from services.frontend.api_keys import ApiKeyInterceptor, ApiKeys
from services.frontend.app import create_app
from services.frontend.config import ENGINE_GRPC_OFF, FrontendConfig
from services.frontend.engine_protocol import EngineClientProtocol
from services.frontend.grpc_service import SERVICE_NAME, GenerateServicer
from services.frontend.observability import FrontendObserver, install
from services.frontend.serving_engine import OpenAIServing, ServerState, ServingModel
from services.frontend.generation_defaults import load_generation_defaults
from services.frontend.tokenizer import load_tokenizer
from services.frontend.vllm_engine.codec import SamplingDefaults
from services.frontend.vllm_engine.servicer import SERVICE_NAME as ENGINE_SERVICE_NAME
from services.frontend.vllm_engine.servicer import VllmEngineServicer

logger = logging.getLogger("spindle.frontend")

READINESS_POLL_S = 0.5


class FrontendServer:
    """The frontend's servers and their lifecycle; `start()` then `stop()`."""

    def __init__(self, config: FrontendConfig, engine_client: EngineClientProtocol | None = None,
                 model: ServingModel | None = None, model_dir: Path | None = None):
        """`model` and `model_dir` (its folder: config.json and tokenizer files, for VllmEngine's
        GetModelInfo and GetTokenizer) are loaded from `config.model` when `model` is None."""
        self.config = config
        self.state = ServerState()
        self.engine_client = engine_client
        self.model = model
        self.model_dir = model_dir
        self._runner: web.AppRunner | None = None
        self._grpc: GrpcServer | None = None
        self._engine_grpc: GrpcServer | None = None
        self._readiness_task: asyncio.Task | None = None
        self.tracing = None  # services/common/telemetry.Tracing when an OTLP endpoint is configured
        self.observer: FrontendObserver | None = None
        self.http_port = 0
        self.grpc_port = 0
        self.engine_grpc_port = 0  # 0 while off

    async def start(self) -> None:
        self.tracing = setup_tracing("spindle-frontend", self.config.telemetry.otlp_traces_endpoint)
        if self.model is None:
            self.model, self.model_dir = await asyncio.to_thread(_load_model, self.config)
        if self.engine_client is None:
            from services.frontend.engine_client import EngineClient  # the integrator's module

            self.engine_client = EngineClient(self.config.scheduler_addr, client_interceptors(self.tracing),
                                              auth=self.config.scheduler_auth,
                                              max_wait_s=self.config.engine_wait_timeout_s)
            await self.engine_client.start()

        # Observability hook: /metrics, spans and request metrics (services/frontend/observability.py).
        self.observer = FrontendObserver(self.engine_client, self.model.name, self.tracing)
        self.engine_client.observer = self.observer
        app = create_app(self.engine_client, self.model, self.state, self.observer, self.config.edge,
                         self.config.stream_interval)
        install(app, self.observer)
        # Handlers are cancelled when their client disconnects: that is what aborts its request.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.http_host, self.config.http_port).start()
        self.http_port = self._runner.addresses[0][1]

        # The public API: API keys (when set) are checked before anything else runs.
        api_keys = ApiKeys(self.config.edge.api_keys)
        self._grpc = GrpcServer(self.config.grpc_addr, [SERVICE_NAME],
                                [ApiKeyInterceptor(api_keys), *server_interceptors(self.tracing)],
                                max_receive_message_bytes=self.config.edge.max_grpc_message_bytes)
        serving = OpenAIServing(self.engine_client, self.model, self.state, self.observer, self.config.stream_interval)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(serving, api_keys), self._grpc.server)
        await self._grpc.start()
        self.grpc_port = self._grpc.port
        grpc_host = self.config.grpc_addr.rsplit(":", 1)[0]
        if self.config.engine_grpc_port != ENGINE_GRPC_OFF:
            # The same guards as GenerateService's (the API keys first, the same message size limit),
            # unless the operator opened the port to a gateway that sends no credentials.
            engine_keys = api_keys if self.config.engine_grpc_auth == "api-keys" else ApiKeys()
            if api_keys.is_enabled and not engine_keys.is_enabled:
                logger.warning("--engine-grpc-auth none: the engine gRPC port asks for no API key; keep it "
                               "reachable by the gateway only")
            self._engine_grpc = GrpcServer(f"{grpc_host}:{self.config.engine_grpc_port}", [ENGINE_SERVICE_NAME],
                                           [ApiKeyInterceptor(engine_keys), *server_interceptors(self.tracing)],
                                           max_receive_message_bytes=self.config.edge.max_grpc_message_bytes)
            vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
                VllmEngineServicer(serving, engine_keys, self.model_dir,
                                   SamplingDefaults(self.model.generation_defaults)),
                self._engine_grpc.server)
            await self._engine_grpc.start()
            self.engine_grpc_port = self._engine_grpc.port
        self._readiness_task = asyncio.create_task(self._follow_readiness())
        engine_grpc = f"{grpc_host}:{self.engine_grpc_port}" if self._engine_grpc is not None else "off"
        logger.info("frontend ready: http://%s:%d (grpc %s:%d, vllm engine grpc %s, model %s)", self.config.http_host,
                    self.http_port, grpc_host, self.grpc_port, engine_grpc, self.model.name)

    def _grpc_servers(self) -> list[GrpcServer]:
        return [server for server in (self._grpc, self._engine_grpc) if server is not None]

    async def _follow_readiness(self) -> None:
        """Keeps gRPC health in step with the engine (the HTTP /health asks on each call): woken
        when the engine's readiness turns, so both answer alike; polled too, for a client without
        the hook."""
        changed = asyncio.Event()
        self.engine_client.on_readiness_change = changed.set
        is_serving: bool | None = None
        while True:
            changed.clear()
            now = bool(self.engine_client.is_ready) and not self.state.is_draining
            if now != is_serving:
                for server in self._grpc_servers():
                    await server.set_serving(now)
                if is_serving is not None or now:
                    logger.info("engine %s", "ready: serving requests" if now else "not ready: refusing requests")
                is_serving = now
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), READINESS_POLL_S)

    async def stop(self) -> None:
        """Drains: refuse new requests, let in-flight ones finish up to the shutdown timeout, stop."""
        self.state.is_draining = True
        if self._readiness_task is not None:
            self._readiness_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness_task
        for server in self._grpc_servers():
            await server.set_serving(False)
        if not await self.state.wait_idle(self.config.shutdown_timeout_s):
            logger.warning("%d requests still running after %.0f s; aborting them",
                           self.state.num_inflight, self.config.shutdown_timeout_s)
        if self._runner is not None:
            await self._runner.cleanup()  # cancels leftover handlers, which aborts their requests
        for server in self._grpc_servers():
            await server.stop(grace_s=1.0)
        if self.engine_client is not None and hasattr(self.engine_client, "close"):
            await self.engine_client.close()
        if self.model is not None:
            self.model.async_tokenizer.close()  # drops queued tokenizer work of requests already gone
        if self.tracing is not None:
            self.tracing.shutdown()  # exports the spans still queued
        logger.info("frontend stopped")


def _load_model(config: FrontendConfig) -> tuple[ServingModel, Path]:
    from services.common.model_files import eos_token_ids, resolve_model  # converts the default model on first use

    resolved = resolve_model(config.model, config.cache_dir)
    tokenizer = load_tokenizer(resolved.path)
    defaults = load_generation_defaults(resolved.path, resolved.name, config.override_generation_config)
    logger.info("sampling defaults for unset fields: %s", defaults or "none (the API's)")
    return ServingModel(
        name=config.served_model_name or resolved.name,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(resolved.path, tokenizer.eos_token_id),
        max_model_len=config.max_model_len,
        chat_template_path=config.chat_template,
        tool_call_parser=config.tool_call_parser,
        generation_defaults=defaults,
    ), resolved.path


async def serve(config: FrontendConfig, server: FrontendServer | None = None) -> int:
    """Runs until SIGTERM/SIGINT, then drains; returns the exit status."""
    stop = asyncio.Event()
    server = server or FrontendServer(config)
    install_stop_signals(stop, lambda _signum: setattr(server.state, "is_draining", True))
    starting = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # a signal during start-up (model conversion, scheduler not up yet)
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    elif starting.exception() is not None:
        stopping.cancel()
        logger.error("frontend failed to start", exc_info=starting.exception())
        await server.stop()
        return 1
    else:
        await stopping
    await server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        config = FrontendConfig.from_args(argv)
    except ValueError as exc:  # a bad flag value: one line, not a traceback
        print(f"frontend: {exc}", file=sys.stderr)
        return 2
    setup_logging("frontend", config.log_level)
    return event_loop.run(serve(config))
