"""The event loop each service runs on: uvloop (libuv's loop), as vLLM's servers run.

Served with the three services on one 2-core machine, the worker waited for its next step about
0.25 s less per 32-request scenario on uvloop than on asyncio's selector loop (docs/benchmarks.md,
thirteenth session): the gRPC and HTTP wake-ups between steps are cheaper. grpc.aio and aiohttp run
on any asyncio loop.
"""
from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on a new uvloop loop."""
    return uvloop.run(main)
