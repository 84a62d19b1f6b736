"""`python -m services.scheduler`: the engine core service."""
from __future__ import annotations

import asyncio
import sys

from services.common.logging_setup import setup_logging


def main(argv: list[str] | None = None) -> int:
    from services.scheduler.config import config_from_args
    from services.scheduler.server import serve

    config = config_from_args(argv)
    setup_logging("scheduler", config.log_level)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
