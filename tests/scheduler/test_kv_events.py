"""Prefix-cache events for cache-aware routers: every block the cache registers is reported once
with its tokens and its parent, every evicted one is reported removed, a reset clears all; nothing
is recorded while nobody listens."""
from __future__ import annotations

import asyncio

from services.common import codec
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, to_int64
from services.scheduler.kv_cache_manager import NONE_HASH, hash_block_tokens
from services.scheduler.kv_event_publisher import MAX_QUEUED_BATCHES, KVEventPublisher
from tests.scheduler.factories import fake_runner_output, make_requests, make_scheduler, run_to_completion


def test_stored_blocks_carry_their_tokens_and_chain_to_their_parent():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    kv = scheduler.kv_cache_manager
    kv.enable_events(True)
    request, = make_requests(1, prompt_len=10, max_tokens=3)
    prompt = list(request.prompt_token_ids)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    events = kv.take_events()
    h0 = hash_block_tokens(NONE_HASH, prompt[:4])
    h1 = hash_block_tokens(h0, prompt[4:8])
    # The prefill fills two blocks at once; the third fills when the 12th token is computed.
    assert events[0] == BlockStored([h0, h1], None, prompt[:8], 4)
    assert len(events) == 2 and events[1].parent_block_hash == h1 and len(events[1].token_ids) == 4
    assert kv.take_events() == []


def test_evictions_and_resets_are_reported_and_a_reset_waits_for_idle_blocks():
    scheduler = make_scheduler(num_blocks=6, block_size=4)  # 5 usable blocks
    kv = scheduler.kv_cache_manager
    kv.enable_events(True)
    first, = make_requests(1, prompt_len=8, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    stored = [h for e in kv.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) == 2
    second, = make_requests(1, prompt_len=19, max_tokens=1)  # needs all five blocks: evicts both
    scheduler.add_request(second)
    step = scheduler.schedule()
    assert not kv.reset_prefix_cache()  # a request holds blocks
    scheduler.update_from_output(step, fake_runner_output(scheduler, step))
    events = kv.take_events()
    assert events[0] == BlockRemoved(stored[::-1])  # a freed request's tail is evicted first
    run_to_completion(scheduler)
    kv.take_events()
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.block_pool.cached_block_hash_to_block == {}


def test_nothing_is_recorded_while_disabled():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    request, = make_requests(1, prompt_len=10, max_tokens=3)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert scheduler.kv_cache_manager.take_events() == []
    assert scheduler.kv_cache_manager.block_pool.removed_hashes is None


def test_the_publisher_numbers_batches_starts_each_subscriber_cleared_and_drops_laggards():
    async def scenario():
        publisher = KVEventPublisher()
        queue = publisher.subscribe()
        first = queue.get_nowait()
        assert first.events == [AllBlocksCleared()]
        publisher.publish([])  # an event-free step sends nothing
        assert queue.empty()
        publisher.publish([BlockRemoved([5])])
        batch = queue.get_nowait()
        assert batch.sequence_number == first.sequence_number + 1 and batch.events == [BlockRemoved([5])]
        for _ in range(MAX_QUEUED_BATCHES):
            publisher.publish([BlockRemoved([6])])
        assert not publisher.has_subscribers
        items = [queue.get_nowait() for _ in range(queue.qsize())]
        assert items[-1] is None

    asyncio.run(scenario())


def test_a_later_subscriber_leaves_no_gap_in_the_earlier_ones_numbers():
    # Gateways resubscribe when a stream skips a number; two of them on one engine used to make
    # each other's gaps, one per batch.
    async def scenario():
        publisher = KVEventPublisher()
        earlier = publisher.subscribe()
        earlier.get_nowait()
        publisher.publish([BlockRemoved([5])])
        last = earlier.get_nowait().sequence_number
        later = publisher.subscribe()
        cleared = later.get_nowait()
        assert (cleared.sequence_number, cleared.events) == (last, [AllBlocksCleared()])
        publisher.publish([BlockRemoved([6])])
        assert earlier.get_nowait().sequence_number == later.get_nowait().sequence_number == last + 1

    asyncio.run(scenario())


def test_batches_cross_the_wire_with_signed_hashes():
    big = (1 << 64) - 5
    sent = KVEventBatch(3, 1.5, [BlockStored([big, 7], big, [1, 2, 3, 4, 5, 6, 7, 8], 4), BlockRemoved([big]),
                                 AllBlocksCleared()])
    batch = codec.kv_event_batch_from_pb(codec.kv_event_batch_to_pb(sent))
    assert batch.sequence_number == 3 and batch.timestamp == 1.5
    assert batch.events == [BlockStored([to_int64(big), 7], to_int64(big), [1, 2, 3, 4, 5, 6, 7, 8], 4),
                            BlockRemoved([-5]), AllBlocksCleared()]
