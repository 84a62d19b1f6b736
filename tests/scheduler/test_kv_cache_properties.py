"""Property test: random add/step/abort sequences keep the block pool consistent.

A shadow KV cache records which token each slot was computed for, so a prefix-cache hit can be
checked against what is really in the reused blocks.
"""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.common.messages import EngineCoreRequest, ModelRunnerOutput, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6),
                                   num_blocks=24, block_size=BLOCK_SIZE, max_model_len=48)
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token) computed there
        self.num_added = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(10, 14), max_size=10),
          max_tokens=st.integers(1, 12))
    def add_request(self, prefix, tail, max_tokens):
        self.num_added += 1
        req = EngineCoreRequest(f"r{self.num_added:04d}", prefix + tail, SamplingParams(temperature=0, max_tokens=max_tokens),
                                arrival_time=0.0, eos_token_ids=(0,))
        self.scheduler.add_request(Request(req))

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(token=st.integers(10, 14), refused=st.one_of(st.none(), st.integers(0, 5)))
    def step(self, token, refused):
        """One step as the worker runs it: every scheduled request's keys and values are written
        before any attends (so a hit may read a block written in the same step). `refused`: the
        index of a request the worker refuses to run; its slots of the step stay unwritten (None),
        and a request reading an unwritten slot writes wrong values (None) too."""
        sched = self.scheduler
        kv = sched.kv_cache_manager
        out = sched.schedule()
        scheduled = list(out.num_scheduled_tokens.items())
        refused_id = scheduled[refused][0] if refused is not None and refused < len(scheduled) else None
        written = {}
        for req_id, n in scheduled:
            request = sched.requests[req_id]
            blocks = kv.get_block_ids(req_id)
            start = request.num_computed_tokens - n
            for pos in range(start, start + n):
                written[blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE] = \
                    None if req_id == refused_id else (pos, request.all_token_ids[pos])
        self.slots.update(written)
        for new in out.scheduled_new_reqs:
            # Every prefix-cache hit must hold the request's own tokens once the step's writes are in,
            # unless a request of this very step was refused: then it must be started over.
            hit_slots = [new.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                         for pos in range(new.num_computed_tokens)]
            for pos, slot in enumerate(hit_slots):
                if self.slots.get(slot) is None and refused_id is not None:
                    for own in range(new.num_computed_tokens, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]):
                        self.slots[new.block_ids[own // BLOCK_SIZE] * BLOCK_SIZE + own % BLOCK_SIZE] = None
                    break
                assert self.slots.get(slot) == (pos, new.prompt_token_ids[pos]), "cache hit on a block with other tokens"
        req_ids, sampled = [], []
        for req_id, n in scheduled:
            if req_id == refused_id:
                continue
            request = sched.requests[req_id]
            req_ids.append(req_id)
            sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
        failed = {refused_id: "refused"} if refused_id is not None else {}
        sched.update_from_output(out, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, failed_reqs=failed))
        # Whatever a running request counts as computed holds its own tokens.
        for request in sched.running:
            blocks = kv.get_block_ids(request.request_id)
            for pos in range(request.num_computed_tokens):
                slot = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                assert self.slots.get(slot) == (pos, request.all_token_ids[pos]), \
                    f"{request.request_id} computed on a slot holding {self.slots.get(slot)} at {pos}"

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))  # ids sort in order of arrival
        self.scheduler.abort_requests([req_id])

    @invariant()
    def pool_is_consistent(self):
        kv = self.scheduler.kv_cache_manager
        pool = kv.block_pool
        holders: dict[int, int] = {}
        for blocks in kv.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        free_ids = pool.free_block_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        assert 0 not in free_ids, "the null block was freed"
        for block in pool.blocks[1:]:
            is_free = block.block_id in free_ids
            assert block.ref_cnt == holders.get(block.block_id, 0), f"{block}: holders {holders.get(block.block_id)}"
            assert is_free == (block.ref_cnt == 0), f"{block} free={is_free}"
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash

    def teardown(self):
        sched = self.scheduler
        sched.abort_requests(list(sched.requests))
        pool = sched.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCache = KVCacheMachine.TestCase
