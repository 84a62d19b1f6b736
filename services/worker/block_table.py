"""Host block tables: which KV cache blocks each request of the persistent batch owns.

Row r of the table lists the block ids of the request in batch row r, in token order, so token
position p of that request lives in slot `block_ids[p // block_size] * block_size + p % block_size`.
Unused entries hold 0, the null block.
"""
from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int):
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int64)

    def add_row(self, block_ids: list[int], row: int) -> None:
        """Replaces row `row` with `block_ids`."""
        self.num_blocks_per_row[row] = 0
        self.block_table_np[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"request needs {end} blocks, more than max_model_len allows ({self.max_num_blocks_per_req})"
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        num_blocks = int(self.num_blocks_per_row[src])
        self.block_table_np[dst] = 0
        self.block_table_np[dst, :num_blocks] = self.block_table_np[src, :num_blocks]
        self.num_blocks_per_row[dst] = num_blocks

    def clear_row(self, row: int) -> None:
        self.block_table_np[row] = 0
        self.num_blocks_per_row[row] = 0

    def block_ids(self, row: int) -> list[int]:
        return self.block_table_np[row, : self.num_blocks_per_row[row]].tolist()

    def compute_slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token: `rows[i]` is its batch row, `positions[i]` its position."""
        block_index = positions // self.block_size
        if block_index.size and (block_index >= self.num_blocks_per_row[rows]).any():
            bad = int(np.argmax(block_index >= self.num_blocks_per_row[rows]))
            raise ValueError(
                f"position {int(positions[bad])} of batch row {int(rows[bad])} has no block "
                f"({int(self.num_blocks_per_row[rows[bad]])} blocks assigned)"
            )
        block_ids = self.block_table_np[rows, block_index]
        return block_ids * self.block_size + positions % self.block_size

    def get_tensor(self, rows: np.ndarray, num_blocks: int) -> torch.Tensor:
        """The first `num_blocks` columns of the given rows, as an int64 tensor."""
        return torch.from_numpy(self.block_table_np[rows, :num_blocks])
