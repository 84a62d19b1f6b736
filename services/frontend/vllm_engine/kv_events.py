"""The engine's prefix-cache events in the engine gRPC API's shape (smg's `KvEventBatch`), for a
gateway's cache-aware routing: each stored block with its token ids and the block before it, each
removed block's hash, and a clear when the cache starts over (a subscription's first batch, a new
worker, a flush). Events are numbered per stream from 1."""
from __future__ import annotations

import itertools

from smg_grpc_proto.generated import common_pb2

from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class KvEventBatchEncoder:
    def __init__(self) -> None:
        self._event_ids = itertools.count(1)

    def encode(self, batch: KVEventBatch) -> common_pb2.KvEventBatch:
        msg = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp)
        for event in batch.events:
            out = msg.events.add(event_id=next(self._event_ids))
            if isinstance(event, BlockStored):
                size = event.block_size
                out.stored.blocks.extend(
                    common_pb2.KvBlock(block_hash=h, token_ids=event.token_ids[i * size:(i + 1) * size], block_size=size)
                    for i, h in enumerate(event.block_hashes))
                out.stored.tier = common_pb2.KV_CACHE_TIER_DEVICE
                out.stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
                if event.parent_block_hash is not None:
                    out.stored.parent_block_hash = event.parent_block_hash
            elif isinstance(event, BlockRemoved):
                out.removed.block_hashes.extend(event.block_hashes)
                out.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            elif isinstance(event, AllBlocksCleared):
                out.cleared.SetInParent()
        return msg
