"""What the services themselves accept: their flag parsers, built in a clean environment.

Every flag reads `SPINDLE_<FLAG>` (services/common/flags.py), so the parsers say which variables a
container may set, what they default to, and whether a manifest's values parse.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
from typing import Any, Iterator

from services.common.flags import add_common_flags, env_name

SERVICES = ("frontend", "scheduler", "worker")

# Flags whose defaults the manifests rely on (docs/deploy.md, "Assumptions"): the metrics ports.
# A check below insists that the service defines each one with this default.
ASSUMED_FLAGS: dict[str, dict[str, Any]] = {
    "scheduler": {"SPINDLE_METRICS_PORT": 9092},
    "worker": {"SPINDLE_METRICS_PORT": 9093},
}


@contextlib.contextmanager
def spindle_environment(env: dict[str, str]) -> Iterator[None]:
    """Runs with exactly `env`'s SPINDLE_* variables set (parsers read them when built)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SPINDLE_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("SPINDLE_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("SPINDLE_")]:
            del os.environ[key]
        os.environ.update(saved)


def build_parser(service: str) -> argparse.ArgumentParser:
    if service == "frontend":
        from services.frontend.config import add_frontend_flags

        parser = argparse.ArgumentParser(prog="spindle frontend")
        add_frontend_flags(parser)
        add_common_flags(parser)
        return parser
    if service == "scheduler":
        from services.scheduler.config import build_parser as build_scheduler_parser

        return build_scheduler_parser()
    if service == "worker":
        from services.worker.config import build_parser as build_worker_parser

        return build_worker_parser()
    raise ValueError(f"unknown service {service!r}")


@functools.lru_cache(maxsize=None)
def flag_defaults(service: str) -> dict[str, Any]:
    """SPINDLE_<FLAG> -> the flag's default, for every flag of `service`."""
    with spindle_environment({}):
        parser = build_parser(service)
    return {env_name(action.option_strings[0]): action.default
            for action in parser._actions if action.option_strings and action.option_strings[0].startswith("--")
            and action.dest != "help"}


def parse_config(service: str, env: dict[str, str]) -> Any:
    """The service's frozen config, built from `env` exactly as the container would build it."""
    with spindle_environment(env):
        if service == "frontend":
            from services.frontend.config import FrontendConfig

            return FrontendConfig.from_args([])
        if service == "scheduler":
            from services.scheduler.config import config_from_args

            return config_from_args([])
        from services.worker.config import config_from_args as worker_config_from_args

        return worker_config_from_args([])


def worker_addresses(env: dict[str, str]) -> list[str]:
    """The workers' addresses a scheduler with `env` dials, rank 0 first (one without tensor
    parallelism), as its own config holds them."""
    return list(parse_config("scheduler", env).worker_addrs)
