from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_cache_manager import NONE_HASH, hash_block_tokens
from tests.scheduler.factories import assert_all_blocks_free, make_requests, make_scheduler, run_to_completion

SHARED = list(range(1000, 1064))  # four full blocks of 16


def test_second_request_with_shared_prefix_hits_the_cache():
    scheduler = make_scheduler()
    (first,) = make_requests(1, prompt_len=5, prefix=SHARED, max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    (second,) = make_requests(1, prompt_len=7, prefix=SHARED, max_tokens=2)
    scheduler.add_request(second)
    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 64 and second.num_cached_tokens == 64
    assert out.num_scheduled_tokens[second.request_id] == 7
    stats = scheduler.get_stats()
    assert stats.prefix_cache_hits == 64 and stats.prefix_cache_queries == 69 + 71


def test_fully_cached_prompt_still_recomputes_its_last_token():
    scheduler = make_scheduler()
    (first,) = make_requests(1, prompt_len=0, prefix=SHARED, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    (again,) = make_requests(1, prompt_len=0, prefix=SHARED, max_tokens=1)
    scheduler.add_request(again)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48
    assert out.num_scheduled_tokens[again.request_id] == 16


def test_cache_salt_separates_prefixes():
    assert hash_block_tokens(NONE_HASH, [1, 2, 3], "a") != hash_block_tokens(NONE_HASH, [1, 2, 3], "b")
    assert hash_block_tokens(NONE_HASH, [1, 2, 3]) == hash_block_tokens(NONE_HASH, [1, 2, 3])
    assert hash_block_tokens(NONE_HASH, [1, 2, 3]) != hash_block_tokens(hash_block_tokens(NONE_HASH, [9]), [1, 2, 3])


def test_disabled_prefix_caching_never_hits():
    scheduler = make_scheduler(enable_prefix_caching=False)
    for _ in range(2):
        (r,) = make_requests(1, prompt_len=3, prefix=SHARED, max_tokens=2)
        scheduler.add_request(r)
        run_to_completion(scheduler)
        assert r.num_cached_tokens == 0
    assert_all_blocks_free(scheduler)


def test_free_queue_reuses_unhashed_blocks_before_cached_ones():
    pool = BlockPool(num_blocks=5)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, 111)
    pool.free_blocks([a])  # cached: goes to the back
    pool.free_blocks([b])  # unhashed: goes to the front
    assert pool.free_block_queue.block_ids()[0] == b.block_id
    assert pool.free_block_queue.block_ids()[-1] == a.block_id
    (taken,) = pool.get_new_blocks(1)
    assert taken is b and pool.get_cached_block(111) is a
    # Taking the cached block evicts its hash.
    pool.free_blocks([c, taken])
    taken = pool.get_new_blocks(pool.num_free_blocks)
    assert a in taken and pool.get_cached_block(111) is None
