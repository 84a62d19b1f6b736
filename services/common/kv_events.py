"""What the KV cache manager tells subscribers about the prefix cache, so a router can send
requests to the engine that holds their prefix (the engine gRPC API's SubscribeKvEvents).

Block hashes are the scheduler's own (64-bit, chained through the parent block), as signed 64-bit
integers on the wire; a stored block carries its token ids so a subscriber can index it by
content. Batches are numbered per scheduler, one number per published batch; a subscription's
first batch, `AllBlocksCleared`, carries the last number published (0 on a fresh engine), so every
subscriber sees consecutive numbers. A new worker's cache also starts with `AllBlocksCleared`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]  # consecutive blocks of one request, in order
    parent_block_hash: int | None  # the block before the first one; None at a prompt's start
    token_ids: list[int]  # block_size per block, concatenated
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True)
class KVEventBatch:
    sequence_number: int
    timestamp: float
    events: list[KVCacheEvent] = field(default_factory=list)


def to_int64(value: int) -> int:
    """A 64-bit hash as the signed integer that carries its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value
