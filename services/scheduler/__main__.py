"""`python -m services.scheduler`: the engine core service."""
from __future__ import annotations

import sys

from services.common import event_loop
from services.common.logging_setup import setup_logging


def main(argv: list[str] | None = None) -> int:
    from services.scheduler.config import config_from_args
    from services.scheduler.server import serve

    try:
        config = config_from_args(argv)
    except ValueError as exc:  # a bad flag value: one line, not a traceback
        print(f"scheduler: {exc}", file=sys.stderr)
        return 2
    setup_logging("scheduler", config.log_level)
    return event_loop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
