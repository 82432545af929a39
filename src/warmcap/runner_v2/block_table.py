"""Persistent block tables: one int32 table per KV group, one row per request slot.

Rows live on the host (numpy) so adding, appending and clearing cost no device work; the step
gathers the scheduled rows in batch order into the runner's static buffers. Every change bumps an
epoch shared by a request's groups: the static buffers keep the rows they were loaded with until
the epoch or the step's rows change (``runner_v2/step_buffers.py``), so a decode step between two
block boundaries copies no table at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch


class BlockTable:
    """Block ids of one KV group: ``table[row, col]`` is the block holding column ``col`` of the
    request in ``row``; ``num_blocks[row]`` counts the columns the request holds."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, epoch: list[int] | None = None) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        #: bumped by every change (one counter shared by the groups of a :class:`BlockTables`)
        self._epoch = [0] if epoch is None else epoch

    @property
    def epoch(self) -> int:
        """Changes so far: equal epochs mean equal contents."""
        return self._epoch[0]

    def add_row(self, row: int, block_ids: Sequence[int]) -> None:
        """Give ``row`` to a request holding ``block_ids``; only its own columns are written."""
        n = len(block_ids)
        self._check_width(row, n)
        self.table[row, :n] = block_ids
        self.num_blocks[row] = n
        self._epoch[0] += 1

    def append(self, row: int, new_ids: Sequence[int]) -> None:
        """Append ``new_ids`` after the blocks the row already holds."""
        if not new_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(new_ids)
        self._check_width(row, end)
        self.table[row, start:end] = new_ids
        self.num_blocks[row] = end
        self._epoch[0] += 1

    def clear_row(self, row: int) -> None:
        """Forget the row's blocks: zero it (the null block) so no stale id survives a reuse."""
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._epoch[0] += 1

    def row(self, row: int) -> list[int]:
        """The block ids ``row`` holds, in column order."""
        return self.table[row, : self.num_blocks[row]].tolist()

    def gather(self, rows: Iterable[int] | np.ndarray) -> torch.Tensor:
        """The rows of this step in batch order, ``[len(rows), max_blocks_per_req]`` int32 (a copy)."""
        return torch.from_numpy(self.table[np.asarray(rows, dtype=np.int64)])

    def _check_width(self, row: int, n: int) -> None:
        if n > self.max_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {n} blocks but the table is {self.max_blocks_per_req} wide: "
                "the scheduler reserved past max_model_len + lookahead"
            )


class BlockTables:
    """The block tables of every KV group, addressed by group name."""

    def __init__(self, group_names: Sequence[str], max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self._epoch = [0]
        self.tables = {
            name: BlockTable(max_num_reqs, max_blocks_per_req, self._epoch) for name in group_names
        }

    @property
    def epoch(self) -> int:
        """Changes to any group's table so far (equal epochs: every table as it was)."""
        return self._epoch[0]

    def __getitem__(self, group: str) -> BlockTable:
        return self.tables[group]

    @property
    def group_names(self) -> list[str]:
        return list(self.tables)

    def add_row(self, row: int, block_ids: dict[str, list[int]]) -> None:
        """Give ``row`` to a request; groups missing from ``block_ids`` get an empty row."""
        for name, table in self.tables.items():
            table.add_row(row, block_ids.get(name, ()))

    def append(self, row: int, new_ids: dict[str, list[int]]) -> None:
        for name, ids in new_ids.items():
            self.tables[name].append(row, ids)

    def clear_row(self, row: int) -> None:
        for table in self.tables.values():
            table.clear_row(row)

    def row(self, row: int) -> dict[str, list[int]]:
        return {name: table.row(row) for name, table in self.tables.items()}

    def max_num_blocks(self, rows: np.ndarray) -> int:
        """The widest row among ``rows`` across groups (columns a step actually needs)."""
        if len(rows) == 0:
            return 0
        return max(int(t.num_blocks[rows].max()) for t in self.tables.values())
