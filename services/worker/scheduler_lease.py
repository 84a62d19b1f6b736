"""The worker serves one scheduler at a time.

The scheduler owns the block ids of the worker's KV cache and the requests in its runner, so a
second scheduler must not reinitialise the cache or open a second step stream while one runs: it
would fail every running request. The rule, per connection (gRPC peer):

- `InitializeKVCache` is refused while a step stream is open or another initialisation runs;
- `ExecuteModel` is accepted only from the connection whose `InitializeKVCache` came last, once
  per initialisation, and only while no other stream is open.

When a stream ends (the scheduler closed it, died, or its connection dropped) the worker is free
again and the next scheduler initialises it afresh. Everything runs on the server's event loop.
"""
from __future__ import annotations

import itertools

BUSY = "the worker is serving another scheduler"


class SchedulerLease:
    def __init__(self) -> None:
        self._stream_id: int | None = None  # the open step stream, if any
        self._initialized_peer: str | None = None  # whose initialisation the next stream may use
        self._is_initializing = False
        self._ids = itertools.count(1)

    @property
    def is_streaming(self) -> bool:
        return self._stream_id is not None

    def begin_initialize(self) -> str | None:
        """None when the cache may be initialised now (call `end_initialize` after); else why not."""
        if self._stream_id is not None:
            return BUSY
        if self._is_initializing:
            return "another scheduler is initialising the worker"
        self._is_initializing = True
        self._initialized_peer = None
        return None

    def end_initialize(self, peer: str, is_ok: bool) -> None:
        """`peer`'s initialisation finished; when it succeeded, `peer` may open the next stream."""
        self._is_initializing = False
        self._initialized_peer = peer if is_ok else None

    def begin_stream(self, peer: str) -> tuple[int | None, str | None]:
        """(stream id, None) when `peer` may open its step stream; (None, why not) otherwise."""
        if self._stream_id is not None:
            return None, BUSY
        if self._is_initializing or self._initialized_peer != peer:
            return None, "ExecuteModel needs InitializeKVCache first, on the same connection"
        self._initialized_peer = None  # one stream per initialisation
        self._stream_id = next(self._ids)
        return self._stream_id, None

    def end_stream(self, stream_id: int) -> None:
        """The stream ended; a later call for the same stream does nothing."""
        if self._stream_id == stream_id:
            self._stream_id = None
