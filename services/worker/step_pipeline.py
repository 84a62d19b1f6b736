"""One ExecuteModel stream's steps, run back to back in the model thread.

With async scheduling the scheduler keeps the next step queued while the worker runs one. Handing
each step from the event loop to the model thread, and its output back, before the next step may
start costs a few thread wake-ups a step: about 1 ms of an 8 ms single-stream step on a 2-core
machine, where the model's threads hold both cores and each woken thread waits for one. Here the
model thread takes the next queued step itself, and the event loop writes each output while the
following step runs.

Requests arrive on the event loop (`submit`, then `finish` when the stream's requests end); while
any is pending, one drain task holds the model thread and runs them in order. `outputs()` yields
the responses in the same order and ends after the last one once the requests have ended. `close()`
drops the steps not yet started (the stream is gone, or the worker broke).
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Executor
from typing import AsyncIterator, Callable, Generic, TypeVar

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")

_END = object()  # after the stream's last request, and in the outputs after its response


class StepPipeline(Generic[RequestT, ResponseT]):
    def __init__(self, run_step: Callable[[RequestT], ResponseT], executor: Executor,
                 should_stop: Callable[[], bool] = lambda: False):
        """`run_step` runs in the model thread and never raises (a failed step is a response);
        `should_stop` is asked there after each step: True drops the steps still queued."""
        self._run_step = run_step
        self._executor = executor
        self._should_stop = should_stop
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._pending: deque = deque()
        self._is_draining = False  # a drain task holds (or is about to hold) the model thread
        self._is_closed = False
        self._outputs: asyncio.Queue = asyncio.Queue()

    def submit(self, request: RequestT) -> None:
        self._enqueue(request)

    def finish(self) -> None:
        """No more requests: the outputs end after the responses of those submitted."""
        self._enqueue(_END)

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._pending.clear()

    async def outputs(self) -> AsyncIterator[ResponseT]:
        while True:
            item = await self._outputs.get()
            if item is _END:
                return
            yield item

    def _enqueue(self, item) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._pending.append(item)
            if self._is_draining:
                return  # the running drain takes it after the current step
            self._is_draining = True
        try:
            self._executor.submit(self._drain)
        except RuntimeError:  # the executor was shut down: the worker is stopping
            self.close()
            self._outputs.put_nowait(_END)

    def _drain(self) -> None:
        """In the model thread: the pending steps in order, until none is left."""
        while True:
            with self._lock:
                if self._is_closed or not self._pending:
                    self._is_draining = False
                    return
                item = self._pending.popleft()
            if item is _END:
                self._emit(_END)
                continue
            self._emit(self._run_step(item))
            if self._should_stop():
                self.close()

    def _emit(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody reads the outputs any more
            self.close()
