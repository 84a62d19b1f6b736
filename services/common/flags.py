"""Command-line flags that also read `SPINDLE_<FLAG>` environment variables.

A flag given on the command line wins over the environment, which wins over the default.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    return "SPINDLE_" + flag.lstrip("-").upper().replace("-", "_")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    choices: list[str] | None = None,
) -> None:
    """Adds `--flag` whose default comes from `SPINDLE_FLAG` when that variable is set."""
    name = env_name(flag)
    raw = os.environ.get(name)
    if type is bool:
        value = _parse_bool(raw) if raw is not None else default
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=f"{help} [{name}]")
        return
    value = type(raw) if raw is not None else default
    parser.add_argument(flag, type=type, default=value, help=f"{help} [{name}]", choices=choices)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """Flags every service takes."""
    add_flag(parser, "--log-level", default="INFO", help="logging level")
    add_flag(parser, "--shutdown-timeout", type=float, default=30.0,
             help="seconds in-flight work may take to finish after SIGTERM")
