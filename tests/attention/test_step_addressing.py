"""The one builder of a step's addressing: block tables and query rows from a BatchLayout."""

from __future__ import annotations

import numpy as np
import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.attention.backend import (
    BatchLayout,
    SequenceLayout,
    block_table_array,
    decode_tables,
    write_block_tables,
)

BLOCK_SIZE = 4
# A decode whose request holds a block past its tokens, a decode on a block's last slot, a
# fresh prompt and a chunk on cached context.
SEQUENCES = [
    SequenceLayout(query_len=1, num_context_tokens=4, block_table=[7, 2, 9]),
    SequenceLayout(query_len=1, num_context_tokens=7, block_table=[3, 5]),
    SequenceLayout(query_len=6, num_context_tokens=0, block_table=[11, 12]),
    SequenceLayout(query_len=3, num_context_tokens=9, block_table=[0, 1, 4, 6]),
]


def test_ceil_div_rounds_up():
    assert [ceil_div(tokens, BLOCK_SIZE) for tokens in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert ceil_div(7.0, 2.0) == 4.0


def test_block_tables_hold_each_sequences_blocks_then_zeros():
    table = block_table_array(SEQUENCES, BLOCK_SIZE)
    assert table.dtype == np.int32
    assert table.tolist() == [[7, 2, 0], [3, 5, 0], [11, 12, 0], [0, 1, 4]]


def test_writing_block_tables_leaves_the_rest_of_each_row():
    table = np.full((6, 5), -1, dtype=np.int32)
    write_block_tables(SEQUENCES, BLOCK_SIZE, table)
    assert table[:4].tolist() == [
        [7, 2, -1, -1, -1],
        [3, 5, -1, -1, -1],
        [11, 12, -1, -1, -1],
        [0, 1, 4, -1, -1],
    ]
    assert (table[4:] == -1).all()


def test_query_rows_follow_the_batch_order():
    layout = BatchLayout(SEQUENCES, 2, BLOCK_SIZE)
    assert layout.query_rows() == [(0, 4, 1), (1, 7, 1), (2, 0, 6), (8, 9, 3)]


def test_decode_tables_address_the_decode_rows():
    slot_mapping = torch.tensor([2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 3])
    tables = decode_tables(SEQUENCES[:2], BLOCK_SIZE, slot_mapping)
    assert tables.block_table.dtype == tables.seq_lens.dtype == torch.long
    assert tables.block_table.tolist() == [[7, 2], [3, 5]]
    assert tables.seq_lens.tolist() == [5, 8]
    assert torch.equal(tables.slot_mapping, slot_mapping)
