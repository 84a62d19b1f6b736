"""`python -m services.worker`: the worker service."""
from __future__ import annotations

import sys

from services.common import event_loop
from services.common.logging_setup import setup_logging


def main(argv: list[str] | None = None) -> int:
    from services.worker.config import config_from_args

    try:
        config = config_from_args(argv)
    except ValueError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    setup_logging("worker", config.log_level)
    from services.worker.config import resolve_device
    from services.worker.server import serve

    try:
        resolve_device(config.device)
    except ValueError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    return event_loop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
