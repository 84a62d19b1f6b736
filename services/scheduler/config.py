"""Scheduler configuration: built once from flags and environment, frozen."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.flags import add_common_flags, add_flag
from services.common.service_auth import (
    FRONTEND_IDENTITY,
    NO_SERVICE_AUTH,
    ServiceAuthConfig,
    add_service_auth_flags,
    service_auth_config_from_args,
)
from services.common.telemetry import TelemetryConfig, add_telemetry_flags, telemetry_config_from_args


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduling rule needs. Block size and block count come from the worker at run time."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_num_waiting_requests: int = 0  # 0 = unbounded
    policy: str = "fcfs"  # or "priority"
    enable_prefix_caching: bool = True
    # Schedule step N+1 while the worker runs step N (its sampled tokens are placeholders until then):
    # the scheduler's work and both gRPC hops then overlap the model instead of adding to each step.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")


@dataclass(frozen=True)
class SchedulerServiceConfig:
    scheduler_addr: str
    # The worker's address; under tensor parallelism the ranks' addresses, rank 0 first.
    worker_addrs: tuple[str, ...]
    log_level: str
    shutdown_timeout_s: float
    scheduler: SchedulerConfig
    # A step not taken or answered within this is a lost worker (hung: stopped, deadlocked); 0: never.
    worker_step_timeout_s: float = 30.0
    telemetry: TelemetryConfig = TelemetryConfig()
    # Who may call this scheduler (frontends), and the credentials it presents to its worker.
    auth: ServiceAuthConfig = NO_SERVICE_AUTH

    def __post_init__(self) -> None:
        if self.worker_step_timeout_s < 0:
            raise ValueError("worker_step_timeout_s must be >= 0 (0 disables the timeout)")


def rank_addresses(worker_addr: str, worker_addrs: str, tensor_parallel_size: int) -> list[str]:
    """The ranks' addresses: `worker_addrs` (comma-separated) when given, else one per rank on
    consecutive ports from `worker_addr`'s (rank r at port + r)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if worker_addrs:
        addrs = [a.strip() for a in worker_addrs.split(",") if a.strip()]
        if len(addrs) != tensor_parallel_size:
            raise ValueError(f"--worker-addrs names {len(addrs)} workers, --tensor-parallel-size is {tensor_parallel_size}")
        return addrs
    host, _, port = worker_addr.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--worker-addr {worker_addr!r}: expected host:port")
    return [f"{host}:{int(port) + rank}" for rank in range(tensor_parallel_size)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spindle scheduler", description="Spindle engine core (scheduler)")
    add_flag(parser, "--scheduler-addr", default="127.0.0.1:50052", help="gRPC address to listen on")
    add_flag(parser, "--worker-addr", default="127.0.0.1:50053",
             help="gRPC address of the worker (of rank 0 under tensor parallelism; rank r at its port + r)")
    add_flag(parser, "--tensor-parallel-size", type=int, default=1,
             help="worker ranks that split the model, each a worker service (the workers read the same flag)")
    add_flag(parser, "--worker-addrs", default="",
             help="the ranks' addresses, comma-separated, rank 0 first (default: from --worker-addr)")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step")
    add_flag(parser, "--max-num-seqs", type=int, default=256, help="most requests running at once")
    add_flag(parser, "--max-num-waiting-requests", type=int, default=0,
             help="refuse new requests once this many wait (0: unbounded)")
    add_flag(parser, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"], help="queue order")
    add_flag(parser, "--enable-prefix-caching", type=bool, default=True, help="reuse KV blocks of shared prefixes")
    add_flag(parser, "--async-scheduling", type=bool, default=True,
             help="schedule the next step while the worker runs this one (two steps in flight)")
    add_flag(parser, "--worker-step-timeout-s", type=float, default=30.0,
             help="seconds a worker may take to answer one step before it is treated as lost (its requests "
                  "fail, health turns NOT_SERVING, the engine reconnects); must exceed the slowest legitimate "
                  "step at the configured token budget; 0 disables it")
    add_telemetry_flags(parser, default_metrics_port=9092)
    add_service_auth_flags(parser, accepts_token_of="scheduler", sends_token_to="worker",
                           default_allowed_clients=FRONTEND_IDENTITY)
    add_common_flags(parser)
    return parser


def config_from_args(argv: list[str] | None = None) -> SchedulerServiceConfig:
    args = build_parser().parse_args(argv)
    return SchedulerServiceConfig(
        scheduler_addr=args.scheduler_addr,
        worker_addrs=tuple(rank_addresses(args.worker_addr, args.worker_addrs, args.tensor_parallel_size)),
        log_level=args.log_level,
        shutdown_timeout_s=args.shutdown_timeout,
        worker_step_timeout_s=args.worker_step_timeout_s,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_num_waiting_requests=args.max_num_waiting_requests,
            policy=args.scheduling_policy,
            enable_prefix_caching=args.enable_prefix_caching,
            async_scheduling=args.async_scheduling,
        ),
        telemetry=telemetry_config_from_args(args),
        auth=service_auth_config_from_args(args),
    )
