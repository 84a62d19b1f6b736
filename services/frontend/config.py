"""The frontend's frozen configuration, built once from flags and `SPINDLE_*` environment variables."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.flags import add_common_flags, add_flag
from services.common.service_auth import (
    NO_SERVICE_AUTH,
    ServiceAuthConfig,
    add_service_auth_flags,
    service_auth_config_from_args,
)
from services.common.telemetry import TelemetryConfig, add_telemetry_flags, telemetry_config_from_args
from services.frontend.public_edge import EdgeConfig, add_edge_flags, edge_config_from_args

DEFAULT_ENGINE_GRPC_PORT = 50055
ENGINE_GRPC_OFF = -1


@dataclass(frozen=True)
class FrontendConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_addr: str = "127.0.0.1:50051"
    # vLLM's engine protocol (VllmEngine) on the GenerateService's host: 0 any free port, -1 off. The
    # flag's default is 50055; a config built in code (tests, embedding) takes a free port unless told.
    engine_grpc_port: int = 0
    # "api-keys": the engine port asks for the API keys as the public faces do; "none": it asks for
    # nothing (SMG 1.13 sends no credentials), for a port only the gateway can reach.
    engine_grpc_auth: str = "api-keys"
    scheduler_addr: str = "127.0.0.1:50052"
    # Model name or path given to `resolve_model`; None means the embedded default model.
    model: str | None = None
    # The name clients put in `model`; None means the resolved model's name.
    served_model_name: str | None = None
    cache_dir: str | None = None
    # Lowers the engine's context length for this frontend; None keeps the engine's.
    max_model_len: int | None = None
    shutdown_timeout_s: float = 30.0
    # How long a request waits for a ready engine while the engine client hands over from one that
    # drained or went away (0: refuse at once).
    engine_wait_timeout_s: float = 10.0
    log_level: str = "INFO"
    # A Jinja chat template file to use instead of the model's own; None: the model's.
    chat_template: str | None = None
    # Parses `tool_choice: auto` output into tool calls: "hermes" or "llama3_json".
    tool_call_parser: str = "hermes"
    # JSON object of sampling defaults over the model's generation_config.json ones.
    override_generation_config: str | None = None
    # A streamed request gets its tokens every this many (its first and its last at once): fewer
    # chunks, wake-ups and socket writes per token, in coarser steps (SGLang's and vLLM's option).
    stream_interval: int = 1
    # The OTLP traces endpoint; metrics are served on the HTTP port (/metrics), so no metrics port.
    telemetry: TelemetryConfig = TelemetryConfig()
    # The public ports' guards: API keys, /metrics behind them or not, request size limits.
    edge: EdgeConfig = EdgeConfig()
    # The credentials this frontend presents to the scheduler (not its public API's).
    scheduler_auth: ServiceAuthConfig = NO_SERVICE_AUTH

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if not ENGINE_GRPC_OFF <= self.engine_grpc_port <= 65535:
            raise ValueError(f"--engine-grpc-port must be in [0, 65535] or {ENGINE_GRPC_OFF} (off), "
                             f"got {self.engine_grpc_port}")
        if self.engine_grpc_auth not in ("api-keys", "none"):
            raise ValueError(f"--engine-grpc-auth must be api-keys or none, got {self.engine_grpc_auth!r}")
        for flag, addr in (("--frontend-grpc-addr", self.grpc_addr), ("--scheduler-addr", self.scheduler_addr)):
            if ":" not in addr:
                raise ValueError(f"{flag} must be host:port, got {addr!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.engine_wait_timeout_s < 0:
            raise ValueError(f"--engine-wait-timeout must be >= 0, got {self.engine_wait_timeout_s}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> FrontendConfig:
        return cls(
            http_host=ns.http_host,
            http_port=ns.http_port,
            grpc_addr=ns.frontend_grpc_addr,
            engine_grpc_port=ns.engine_grpc_port,
            engine_grpc_auth=ns.engine_grpc_auth,
            scheduler_addr=ns.scheduler_addr,
            model=ns.model or None,
            served_model_name=ns.served_model_name or None,
            cache_dir=ns.cache_dir or None,
            max_model_len=ns.max_model_len or None,
            shutdown_timeout_s=ns.shutdown_timeout,
            engine_wait_timeout_s=ns.engine_wait_timeout,
            log_level=ns.log_level,
            chat_template=ns.chat_template or None,
            tool_call_parser=ns.tool_call_parser,
            override_generation_config=ns.override_generation_config or None,
            stream_interval=ns.stream_interval,
            telemetry=telemetry_config_from_args(ns),
            edge=edge_config_from_args(ns),
            scheduler_auth=service_auth_config_from_args(ns),
        )

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> FrontendConfig:
        parser = argparse.ArgumentParser(prog="python -m services.frontend", description="Spindle frontend")
        add_frontend_flags(parser)
        add_common_flags(parser)
        return cls.from_namespace(parser.parse_args(argv))


def add_frontend_flags(parser: argparse.ArgumentParser) -> None:
    """The frontend's own flags (a combined CLI adds these next to the other services')."""
    add_flag(parser, "--http-host", default="127.0.0.1", help="address the OpenAI HTTP API listens on")
    add_flag(parser, "--http-port", type=int, default=8000, help="port of the OpenAI HTTP API (0: any free port)")
    add_flag(parser, "--frontend-grpc-addr", default="127.0.0.1:50051", help="host:port of the GenerateService")
    add_flag(parser, "--engine-grpc-port", type=int, default=DEFAULT_ENGINE_GRPC_PORT,
             help="port of vLLM's engine gRPC protocol (VllmEngine, for gateways such as SMG) on the "
                  f"--frontend-grpc-addr host (0: any free port, {ENGINE_GRPC_OFF}: off)")
    add_flag(parser, "--engine-grpc-auth", default="api-keys",
             help="api-keys: the engine port asks for --api-key as the public faces do; none: it asks for "
                  "nothing (a gateway that sends no credentials, such as SMG 1.13, on a port only it can reach)")
    add_flag(parser, "--scheduler-addr", default="127.0.0.1:50052", help="host:port of the scheduler")
    add_flag(parser, "--engine-wait-timeout", type=float, default=10.0,
             help="seconds a request waits for a ready engine while the frontend reconnects from one that "
                  "drained or went away (0: refuse at once with 503)")
    add_flag(parser, "--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    add_flag(parser, "--served-model-name", default=None, help="model name clients send (default: the model's)")
    add_flag(parser, "--cache-dir", default=None, help="cache folder for converted models")
    add_flag(parser, "--max-model-len", type=int, default=None, help="lower the engine's context length")
    add_flag(parser, "--chat-template", default=None,
             help="Jinja chat template file used instead of the model's own (tools reach it as `tools`)")
    add_flag(parser, "--override-generation-config", default=None,
             help='JSON sampling defaults for unset request fields, over generation_config.json\'s '
                  '(temperature, top_p, top_k, min_p, repetition_penalty), e.g. \'{"temperature": 0.5}\'')
    add_flag(parser, "--stream-interval", type=int, default=1,
             help="a streamed response's tokens are sent every this many (the first and the last at once): "
                  "fewer chunks and less frontend CPU a token, in coarser steps")
    add_flag(parser, "--tool-call-parser", default="hermes",
             help="parser of tool calls in tool_choice=auto output: hermes or llama3_json")
    add_telemetry_flags(parser)
    add_edge_flags(parser)
    add_service_auth_flags(parser, sends_token_to="scheduler")
