"""Persistent block tables: own columns only, append after the held count, clear on release."""

from __future__ import annotations

import numpy as np
import pytest

from warmcap.runner_v2.block_table import BlockTable, BlockTables


def test_add_row_writes_only_its_own_row_and_columns() -> None:
    t = BlockTable(max_num_reqs=3, max_blocks_per_req=5)
    t.add_row(0, [7, 8, 9])
    t.add_row(1, [4])
    assert t.table.tolist() == [[7, 8, 9, 0, 0], [4, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert t.num_blocks.tolist() == [3, 1, 0]


def test_append_continues_after_held_blocks() -> None:
    t = BlockTable(2, 4)
    t.add_row(1, [3])
    t.append(1, [5, 6])
    t.append(1, [])
    assert t.row(1) == [3, 5, 6]
    assert t.row(0) == []
    with pytest.raises(ValueError, match="4 wide"):
        t.append(1, [1, 2])


def test_clear_then_reuse_leaves_no_stale_column() -> None:
    t = BlockTable(2, 4)
    t.add_row(0, [1, 2, 3, 4])
    t.clear_row(0)
    t.add_row(0, [9])
    assert t.table[0].tolist() == [9, 0, 0, 0]


def test_gather_returns_rows_in_batch_order() -> None:
    tables = BlockTables(["full", "sliding_window"], 3, 2)
    tables.add_row(0, {"full": [1], "sliding_window": [2, 3]})
    tables.add_row(2, {"full": [4, 5]})
    assert tables["full"].gather([2, 0]).tolist() == [[4, 5], [1, 0]]
    assert tables["sliding_window"].gather(np.array([2, 0])).tolist() == [[0, 0], [2, 3]]
    assert tables.max_num_blocks(np.array([0, 2])) == 2
    assert tables.row(0) == {"full": [1], "sliding_window": [2, 3]}
