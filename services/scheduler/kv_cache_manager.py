"""KV cache manager: which blocks each request holds, prefix-cache lookups, allocation.

It deals only in block ids; the worker owns the tensors those ids index.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection
from dataclasses import dataclass

from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from services.scheduler.block_pool import BlockPool, KVCacheBlock
from services.scheduler.request import Request

# A fixed seed so every scheduler instance (and restart) computes the same block hashes.
_HASH_SEED = b"spindle-prefix-cache-v1"
NONE_HASH = int.from_bytes(hashlib.sha256(_HASH_SEED).digest()[:8], "little")


def hash_block_tokens(parent_hash: int, token_ids: list[int] | tuple[int, ...], extra_key: str = "") -> int:
    """hash(parent hash, token ids of the block, extra keys such as cache_salt) as a 64-bit int."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    if extra_key:
        h.update(extra_key.encode())
    return int.from_bytes(h.digest(), "little")


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # prompt tokens found


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of each request's leading blocks already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Tokens the blocks each request holds have room for: the scheduler reads it to skip
        # `allocate_slots` (a call per running request per step) while the held blocks suffice.
        self.num_slots_held: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Blocks registered at scheduling, before the step that computes them has run: step id ->
        # [(request id, blocks)]. The step's output confirms them or rolls them back.
        self._unconfirmed: dict[int, list[tuple[str, list[KVCacheBlock]]]] = {}
        # Prefix-cache events since the last `take_events`, recorded only while enabled.
        self._events: list[KVCacheEvent] | None = None

    # --- events (the engine gRPC API's SubscribeKvEvents) ------------------------------------------
    def enable_events(self, is_enabled: bool) -> None:
        """Starts (or stops) recording stored and removed blocks; off, they cost nothing."""
        if is_enabled and self._events is None:
            self._events, self.block_pool.removed_hashes = [], []
        elif not is_enabled:
            self._events = self.block_pool.removed_hashes = None

    def take_events(self) -> list[KVCacheEvent]:
        if self._events is None:
            return []
        events, removed = self._events, self.block_pool.removed_hashes
        self._events, self.block_pool.removed_hashes = [], []
        if removed:  # evictions happen as blocks are allocated, before this step's stores
            events.insert(0, BlockRemoved(removed))
        return events

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; refused (False) while a request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._unconfirmed.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
            self.block_pool.removed_hashes = []
        return True

    # --- lookups ---------------------------------------------------------------------------------
    def usage(self) -> float:
        return self.block_pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Extends the request's list of full-block hashes to cover its current tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else NONE_HASH
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs], request.cache_salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, as (blocks, num_computed_tokens).

        The last prompt token is always recomputed so the step yields logits to sample from.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted request's lookup (a request that waits is looked up again next step)."""
        if self.enable_caching:
            self.prefix_cache_stats.num_queries += num_tokens
            self.prefix_cache_stats.num_hits += num_hit_tokens

    # --- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_tokens_to_fit: int = 0,
    ) -> list[int] | None:
        """Gives the request blocks for `num_new_tokens` more tokens; returns the new block ids.

        Returns None (and changes nothing) when the free blocks do not suffice, or would not suffice
        for the request's first `num_tokens_to_fit` tokens (admission asks for the whole prompt, so
        a chunked prefill rarely has to preempt later). `computed_blocks` are prefix-cache hits,
        passed only when the request is first scheduled.
        """
        held = self.req_to_blocks.get(request.request_id)
        if not computed_blocks and held is not None and \
                request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size:
            return []  # the usual decode step: the held blocks have room
        computed_blocks = computed_blocks or []
        held = held or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(held) - len(computed_blocks)
        num_blocks_to_fit = max(num_new_blocks, self.num_blocks_for(num_tokens_to_fit) - len(held) - len(computed_blocks))
        if num_blocks_to_fit <= 0 and not computed_blocks:
            return []  # the held blocks have room
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_blocks_to_fit > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, held)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self.num_slots_held[request.request_id] = len(blocks) * self.block_size
        if computed_blocks and self.num_cached_blocks.get(request.request_id, 0) == 0:
            self.num_cached_blocks[request.request_id] = len(computed_blocks)
        return [b.block_id for b in computed_blocks] + [b.block_id for b in new_blocks]

    def forget_scheduled_blocks(self, request: Request, step_id: int) -> None:
        """The request's tokens were taken out of step `step_id` before it was sent: the blocks it
        registered ahead for that step leave the prefix cache (nobody was admitted after it)."""
        entries = self._unconfirmed.get(step_id, [])
        for req_id, blocks in [e for e in entries if e[0] == request.request_id]:
            entries.remove((req_id, blocks))
            for block in blocks:
                self.block_pool.uncache_block(block)

    def cache_computed_blocks(self, requests: list[Request | None]) -> None:
        """After a step: registers the blocks full of computed tokens in the prefix cache, for each
        request that still holds blocks (None, or one preempted or finished meanwhile, holds none).
        One call per step, so the usual request (no block filled) costs a lookup, not a call."""
        if not self.enable_caching:
            return
        num_cached_blocks, req_to_blocks, block_size = self.num_cached_blocks, self.req_to_blocks, self.block_size
        for request in requests:
            if request is not None and request.num_computed_tokens // block_size > \
                    num_cached_blocks.get(request.request_id, 0) and request.request_id in req_to_blocks:
                self._cache_full_blocks(request, request.num_computed_tokens)

    def cache_scheduled_blocks(self, request: Request, num_tokens: int, step_id: int) -> None:
        """At scheduling: registers the full blocks of the request's first `num_tokens` whose tokens
        are known (a prompt chunk's; a placeholder for a token in flight stops the hashes), before
        step `step_id` computes them, so that a request admitted later in this step, or in the next
        while this one runs, finds the prefix. The worker writes all of a step's keys and values in
        a layer before any of them attends, and runs steps in order, so a hit reads them written.
        Listed under the step until its output confirms them."""
        if not self.enable_caching or \
                num_tokens // self.block_size <= self.num_cached_blocks.get(request.request_id, 0):
            return
        stored = self._cache_full_blocks(request, num_tokens)
        if stored:
            self._unconfirmed.setdefault(step_id, []).append((request.request_id, stored))

    def confirm_step(self, step_id: int, req_ids: Collection[str], failed_req_ids: Collection[str] = ()) -> set[str]:
        """After step `step_id` (`req_ids`: the requests it ran, less `failed_req_ids`; none if it
        failed): the blocks registered ahead for it are computed, unless their request did not run.
        Then every block still registered ahead, this step's and the steps' in flight, leaves the
        prefix cache, and the ids of the requests holding any are returned: what they computed may
        have read a block that was never written, so they must start over. (Requests that read only
        good blocks may start over too: a rare path, kept simple.)"""
        entries = self._unconfirmed.pop(step_id, None)
        if not entries:
            return set()
        ran = set(req_ids).difference(failed_req_ids)
        if all(req_id in ran for req_id, _ in entries):
            return set()
        entries += [entry for later in self._unconfirmed.values() for entry in later]
        self._unconfirmed.clear()
        # A block evicted meanwhile (its hash gone) was reused and holds nothing of the rollback's.
        suspect = {id(block): block for _, blocks in entries for block in blocks if block.block_hash is not None}
        for block in suspect.values():
            self.block_pool.uncache_block(block)
        return {req_id for req_id, blocks in self.req_to_blocks.items() if any(id(b) in suspect for b in blocks)}

    def _cache_full_blocks(self, request: Request, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Registers the request's blocks that filled up (to `num_computed_tokens`) since the last call;
        returns those it registered."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        self.update_block_hashes(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        stored = []
        for i in range(start, num_full):
            if self.block_pool.cache_full_block(blocks[i], request.block_hashes[i]):
                stored.append(i)
        self.num_cached_blocks[request.request_id] = max(start, num_full)
        if self._events is not None and stored:
            self._record_stored(request, stored)
        return [blocks[i] for i in stored]

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """One event per run of consecutive blocks, chained to the block before it."""
        bs, hashes = self.block_size, request.block_hashes
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self._events.append(BlockStored(
                block_hashes=[hashes[i] for i in run], parent_block_hash=hashes[first - 1] if first else None,
                token_ids=list(request.all_token_ids[first * bs:(last + 1) * bs]), block_size=bs))

    def free(self, request: Request) -> None:
        """Returns all the request's blocks; tail blocks first so they are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_slots_held.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
