"""The worker's own view of a hung step, for its liveness probe.

The scheduler times out a step its worker does not answer (`--worker-step-timeout-s`) and treats
the worker as lost; but a worker whose model thread is stuck (a deadlocked kernel, a step that never
ends) still answers gRPC health from its event loop, so its liveness probe would pass and nothing
would restart it. The watchdog turns health NOT_SERVING while one step has run past the same
timeout (both services read `SPINDLE_WORKER_STEP_TIMEOUT_S`), so the probe fails and the kubelet
restarts the container; if the step ends after all, health turns SERVING again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)


class StepWatchdog:
    def __init__(self, timeout_s: float, set_serving: Callable[[bool], Awaitable[None]],
                 is_ready: Callable[[], bool], check_interval_s: float = 1.0):
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s
        self._set_serving = set_serving
        self._is_ready = is_ready
        # (step id, monotonic start) of the step running now, written by the model thread: one
        # attribute store, so the loop reads either the old or the new pair.
        self._running: tuple[int, float] | None = None
        self.is_overdue = False

    def step_started(self, step_id: int) -> None:
        self._running = (step_id, time.monotonic())

    def step_ended(self) -> None:
        self._running = None

    async def check(self) -> None:
        """One look: flips health when a step became overdue, or when the overdue step ended."""
        running = self._running
        overdue = running is not None and time.monotonic() - running[1] > self.timeout_s
        if overdue and not self.is_overdue:
            logger.error("step %d has run for more than %.0f s (--worker-step-timeout-s): health NOT_SERVING",
                         running[0], self.timeout_s)
            self.is_overdue = True
            await self._set_serving(False)
        elif not overdue and self.is_overdue:
            self.is_overdue = False
            if self._is_ready():  # not while loading or draining
                logger.warning("the overdue step ended: health SERVING again")
                await self._set_serving(True)

    async def run(self) -> None:
        """Checks until cancelled; does nothing when the timeout is 0 (disabled)."""
        if self.timeout_s <= 0:
            return
        while True:
            await asyncio.sleep(self.check_interval_s)
            await self.check()
