from __future__ import annotations

import numpy as np
import pytest

from services.common.messages import SamplingParams
from services.worker.block_table import BlockTable
from services.worker.input_batch import CachedRequestState, InputBatch


def test_slot_mapping_is_block_id_times_block_size_plus_offset():
    table = BlockTable(max_num_reqs=4, max_num_blocks_per_req=8, block_size=4)
    table.add_row([7, 3], row=0)
    table.append_row([9], row=0)
    table.add_row([5], row=1)
    rows = np.array([0, 0, 0, 0, 0, 1])
    positions = np.array([0, 3, 4, 7, 9, 2])
    assert table.compute_slot_mapping(rows, positions).tolist() == [28, 31, 12, 15, 37, 22]
    assert table.get_tensor(np.array([1, 0]), 3).tolist() == [[5, 0, 0], [7, 3, 9]]


def test_slot_mapping_without_a_block_raises():
    table = BlockTable(max_num_reqs=2, max_num_blocks_per_req=4, block_size=4)
    table.add_row([1], row=0)
    with pytest.raises(ValueError, match="no block"):
        table.compute_slot_mapping(np.array([0]), np.array([4]))
    with pytest.raises(ValueError, match="max_model_len"):
        table.append_row([2, 3, 4, 5], row=0)


def _state(req_id: str, n: int, blocks: list[int]) -> CachedRequestState:
    return CachedRequestState(req_id, list(range(100, 100 + n)), SamplingParams(), None, blocks, 0)


def test_input_batch_condense_keeps_rows_dense():
    batch = InputBatch(max_num_reqs=4, max_model_len=32, block_size=4)
    for i, n in enumerate([5, 6, 7]):
        batch.add_request(_state(f"r{i}", n, [i + 1, i + 10]))
    batch.remove_request("r0")
    batch.condense()
    assert batch.num_reqs == 2
    assert sorted(batch.req_id_to_index.values()) == [0, 1]
    row = batch.req_id_to_index["r2"]
    assert batch.block_table.block_ids(row) == [3, 12]
    assert batch.token_ids_cpu[row, :7].tolist() == list(range(100, 107)) and batch.num_tokens[row] == 7
    batch.append_token(row, 42)
    assert batch.requests[row].output_token_ids == [42] and batch.token_ids_cpu[row, 7] == 42


def test_input_batch_refuses_more_than_max_num_reqs():
    batch = InputBatch(max_num_reqs=1, max_model_len=8, block_size=4)
    batch.add_request(_state("a", 2, [1]))
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch.add_request(_state("b", 2, [2]))
