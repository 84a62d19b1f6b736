"""merge_streams: arrival order, the first error wins, leaving early closes every stream."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from services.frontend.fanout import merge_streams


def _stream(name: str, n: int, closed: list[str], delay_s: float = 0.0, fail_at: int | None = None):
    async def gen():
        try:
            for i in range(n):
                await asyncio.sleep(delay_s)
                if i == fail_at:
                    raise ValueError(f"{name} failed")
                yield f"{name}{i}"
        finally:
            closed.append(name)
    return gen()


def test_merges_everything_with_indexes():
    async def scenario():
        closed = []
        streams = [_stream("a", 3, closed, 0.001), _stream("b", 2, closed, 0.002)]
        return [x async for x in merge_streams(streams)], closed

    items, closed = asyncio.run(scenario())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert [i for i in items if i[0] == 0] == [(0, "a0"), (0, "a1"), (0, "a2")]  # order within a stream
    assert sorted(closed) == ["a", "b"]


def test_first_error_is_raised_and_the_others_are_closed():
    async def scenario():
        closed = []
        streams = [_stream("a", 100, closed, 0.01), _stream("b", 5, closed, 0.001, fail_at=2)]
        with pytest.raises(ValueError, match="b failed"):
            async for _ in merge_streams(streams):
                pass
        return closed

    assert sorted(asyncio.run(scenario())) == ["a", "b"]


def test_leaving_early_closes_every_stream():
    async def scenario():
        closed = []
        streams = [_stream("a", 100, closed, 0.001), _stream("b", 100, closed, 0.001)]
        async with aclosing(merge_streams(streams)) as merged:
            async for _ in merged:
                break
        return closed

    assert sorted(asyncio.run(scenario())) == ["a", "b"]
