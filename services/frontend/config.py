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


@dataclass(frozen=True)
class FrontendConfig:
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_addr: str = "127.0.0.1:50051"
    scheduler_addr: str = "127.0.0.1:50052"
    # Model name or path given to `resolve_model`; None means the embedded default model.
    model: str | None = None
    # The name clients put in `model`; None means the resolved model's name.
    served_model_name: str | None = None
    cache_dir: str | None = None
    # Lowers the engine's context length for this frontend; None keeps the engine's.
    max_model_len: int | None = None
    shutdown_timeout_s: float = 30.0
    log_level: str = "INFO"
    # A Jinja chat template file to use instead of the model's own; None: the model's.
    chat_template: str | None = None
    # Parses `tool_choice: auto` output into tool calls: "hermes" or "llama3_json".
    tool_call_parser: str = "hermes"
    # The OTLP traces endpoint; metrics are served on the HTTP port (/metrics), so no metrics port.
    telemetry: TelemetryConfig = TelemetryConfig()
    # The public ports' guards: API keys, /metrics behind them or not, request size limits.
    edge: EdgeConfig = EdgeConfig()
    # The credentials this frontend presents to the scheduler (not its public API's).
    scheduler_auth: ServiceAuthConfig = NO_SERVICE_AUTH

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
        for flag, addr in (("--frontend-grpc-addr", self.grpc_addr), ("--scheduler-addr", self.scheduler_addr)):
            if ":" not in addr:
                raise ValueError(f"{flag} must be host:port, got {addr!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> FrontendConfig:
        return cls(
            http_host=ns.http_host,
            http_port=ns.http_port,
            grpc_addr=ns.frontend_grpc_addr,
            scheduler_addr=ns.scheduler_addr,
            model=ns.model or None,
            served_model_name=ns.served_model_name or None,
            cache_dir=ns.cache_dir or None,
            max_model_len=ns.max_model_len or None,
            shutdown_timeout_s=ns.shutdown_timeout,
            log_level=ns.log_level,
            chat_template=ns.chat_template or None,
            tool_call_parser=ns.tool_call_parser,
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
    add_flag(parser, "--scheduler-addr", default="127.0.0.1:50052", help="host:port of the scheduler")
    add_flag(parser, "--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    add_flag(parser, "--served-model-name", default=None, help="model name clients send (default: the model's)")
    add_flag(parser, "--cache-dir", default=None, help="cache folder for converted models")
    add_flag(parser, "--max-model-len", type=int, default=None, help="lower the engine's context length")
    add_flag(parser, "--chat-template", default=None,
             help="Jinja chat template file used instead of the model's own (tools reach it as `tools`)")
    add_flag(parser, "--tool-call-parser", default="hermes",
             help="parser of tool calls in tool_choice=auto output: hermes or llama3_json")
    add_telemetry_flags(parser)
    add_edge_flags(parser)
    add_service_auth_flags(parser, sends_token_to="scheduler")
