"""What the frontend needs of its engine, as typed interfaces: `EngineClient` (the gRPC stream to
the scheduler) is one implementation, a test's fake engine another."""
from __future__ import annotations

from typing import AsyncIterator, Callable, Protocol

from services.common.kv_events import KVEventBatch
from services.common.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo, SchedulerStats


class StepObserver(Protocol):
    """Sees every engine step's outputs before they reach the requests (the frontend's metrics)."""

    def on_step(self, outputs: EngineCoreOutputs) -> None: ...


class EngineClientProtocol(Protocol):
    # What the engine reported when the client connected; None until then.
    info: EngineInfo | None
    # The latest stats the engine sent (with a step's outputs, or polled).
    last_stats: SchedulerStats
    observer: StepObserver | None
    # Called when `is_ready` turns (an implementation without one is polled).
    on_readiness_change: Callable[[], None] | None

    @property
    def is_ready(self) -> bool:
        """Connected, and the engine has a live worker."""
        ...

    async def wait_ready(self) -> bool:
        """`is_ready`, after waiting (a bounded time) for a handover to a ready engine in progress."""
        ...

    def generate(self, request: EngineCoreRequest, final_only: bool = False, stream_interval: int = 1
                 ) -> AsyncIterator[EngineCoreOutput]:
        """The request's outputs until it finishes; raises EngineError when the engine refuses or
        fails it. Closing the iterator early aborts the request. With `final_only` the outputs come
        merged into one, when the request finishes; otherwise merged every `stream_interval` tokens
        (the first token and the finish at once)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def get_stats(self) -> tuple[SchedulerStats, bool]:
        """The scheduler's stats now, and whether its worker is alive."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Forgets the engine's cached prefixes; False while requests hold KV blocks."""
        ...

    def subscribe_kv_events(self) -> AsyncIterator[KVEventBatch]:
        """The engine's prefix-cache events from now on, a batch per step that had any (the first
        clears what an earlier engine held); raises EngineError when the stream ends."""
        ...
