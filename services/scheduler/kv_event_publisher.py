"""Hands the KV cache manager's prefix-cache events to their subscribers, one numbered batch per
engine step that had any. Events are recorded only while someone subscribes; each subscriber has
a bounded queue, and one that falls that far behind is dropped (its stream ends with an error and
it subscribes again, from a snapshot-free AllBlocksCleared)."""
from __future__ import annotations

import asyncio
import time

from services.common.kv_events import AllBlocksCleared, KVCacheEvent, KVEventBatch

MAX_QUEUED_BATCHES = 1024


class KVEventPublisher:
    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue[KVEventBatch | None]] = set()
        self._sequence_number = 0

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self) -> asyncio.Queue[KVEventBatch | None]:
        """A queue of batches; None in it means the subscriber fell behind and was dropped. The
        first batch clears what the subscriber may have known of an earlier engine."""
        queue: asyncio.Queue[KVEventBatch | None] = asyncio.Queue(MAX_QUEUED_BATCHES)
        self._subscribers.add(queue)
        # The clear carries the last batch's number rather than a new one: a number that only this
        # subscriber sees would be a gap in every other subscriber's stream (a gateway that sees
        # one drops the batch and resubscribes, making the next gap for the others).
        queue.put_nowait(KVEventBatch(self._sequence_number, time.time(), [AllBlocksCleared()]))
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events or not self._subscribers:
            return
        self._sequence_number += 1
        batch = KVEventBatch(self._sequence_number, time.time(), events)
        for queue in list(self._subscribers):
            if queue.qsize() >= MAX_QUEUED_BATCHES - 1:
                self._subscribers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(batch)
