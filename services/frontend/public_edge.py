"""What guards the frontend's public ports, built once from flags: the API keys clients must present,
whether /metrics needs one, and the size limits a request meets before any work is done for it.

Keys come from `--api-key` (repeatable, or comma-separated; `SPINDLE_API_KEY` holds a comma-separated
list and a command-line `--api-key` replaces it) and `--api-key-file` (one key per line; blank lines
and lines starting with `#` are skipped). They are secrets: kept out of the config's repr, and no
message here ever quotes one.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from services.common.flags import add_flag, env_name

# Today's long prompts fit with room to spare (a 1M-token prompt is about 4 MiB of text, 7 MiB of
# ids), and parsing the largest accepted JSON body costs the event loop about 0.3 s.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_GRPC_MESSAGE_BYTES = 16 * 2**20

_API_KEY_FLAG = "--api-key"


@dataclass(frozen=True)
class EdgeConfig:
    # Empty: no authentication. Out of the repr, so that logging a config never prints a key.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # /metrics needs a key too (by default it stays open for scrapers, as /health does for probes).
    protect_metrics: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_grpc_message_bytes: int = DEFAULT_MAX_GRPC_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for i, key in enumerate(self.api_keys):
            # Headers and gRPC metadata carry printable ASCII; the key itself stays out of the message.
            if not key or not all("!" <= c <= "~" for c in key):
                raise ValueError(f"API key #{i + 1} is empty or has a character other than printable, "
                                 "non-space ASCII")
        if self.protect_metrics and not self.api_keys:
            raise ValueError("--protect-metrics needs API keys (--api-key, --api-key-file or SPINDLE_API_KEY)")
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"--max-request-body-bytes must be positive, got {self.max_request_body_bytes}")
        if self.max_grpc_message_bytes <= 0:
            raise ValueError(f"--max-grpc-message-bytes must be positive, got {self.max_grpc_message_bytes}")


class _ApiKeysAction(argparse.Action):
    """`--api-key A --api-key B,C`: every key given; the first one given replaces SPINDLE_API_KEY's."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest)
        if current is self.default:
            current = []
        setattr(namespace, self.dest, [*current, *split_keys(values)])


def split_keys(text: str) -> list[str]:
    return [key.strip() for key in text.split(",") if key.strip()]


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and `#` comments are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror}") from None
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def add_edge_flags(parser: argparse.ArgumentParser) -> None:
    env = env_name(_API_KEY_FLAG)
    parser.add_argument(
        _API_KEY_FLAG, dest="api_key", action=_ApiKeysAction, metavar="KEY",
        default=split_keys(os.environ.get(env, "")),
        help="API key clients must send as 'Authorization: Bearer KEY' on HTTP and gRPC (/health and "
             "gRPC health stay open); repeatable or comma-separated; none: no authentication. Prefer "
             f"--api-key-file or {env}: a command line is visible to other local users [{env}, comma-separated]")
    add_flag(parser, "--api-key-file", default=None,
             help="file of API keys, one per line (blank lines and # comments skipped); adds to --api-key")
    add_flag(parser, "--protect-metrics", type=bool, default=False,
             help="/metrics needs an API key too (default: open, for Prometheus scrapers); needs API keys")
    add_flag(parser, "--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
             help="largest HTTP request body; a larger one gets 413 before it is read")
    add_flag(parser, "--max-grpc-message-bytes", type=int, default=DEFAULT_MAX_GRPC_MESSAGE_BYTES,
             help="largest message the public gRPC API accepts (RESOURCE_EXHAUSTED beyond)")


def edge_config_from_args(ns: argparse.Namespace) -> EdgeConfig:
    keys: Sequence[str] = [*ns.api_key, *(read_key_file(ns.api_key_file) if ns.api_key_file else [])]
    return EdgeConfig(
        api_keys=tuple(dict.fromkeys(keys)),  # duplicates dropped, order kept
        protect_metrics=ns.protect_metrics,
        max_request_body_bytes=ns.max_request_body_bytes,
        max_grpc_message_bytes=ns.max_grpc_message_bytes,
    )
