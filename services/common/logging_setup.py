"""One log format for all services."""
from __future__ import annotations

import logging
import sys


def setup_logging(service: str, level: str = "INFO") -> logging.Logger:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        force=True,
    )
    return logging.getLogger(f"spindle.{service}")
