"""Runs several async streams at once and yields their items as they come, tagged with the stream's index.

`n` > 1 is n engine requests, one per choice; a response merges them. The first stream to fail
fails the whole merge, and leaving the merge early (client gone, error, Abort) closes every stream,
which aborts each one's request in the engine.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator, Sequence, TypeVar

T = TypeVar("T")

_DONE = object()


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yields `(index, item)` for the items of `streams[index]`, in arrival order."""
    if len(streams) == 1:  # the common case needs no tasks
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait((index, item, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, None, exc))
            return
        queue.put_nowait((index, _DONE, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _DONE:
                num_running -= 1
                continue
            yield index, item
    finally:
        # Cancelling a pump closes its stream: the engine request behind it is aborted.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
