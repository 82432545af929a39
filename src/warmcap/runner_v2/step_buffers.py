"""Static per-step device buffers, sized to the maximum, refilled each step by ``copy_from``.

The eager path uses slices of them; graph capture records over them and replays after a refill.
Padding is explicit and benign: padded tokens get id 0, position 0 and slot PAD (-1); padded rows
get a zero (null-block) table row, ``seq_len`` 0 and no query tokens except the padded ones, which
belong to the first padded row.

The buffers hold one row more than ``max_num_reqs``: the spare row owns the padded tokens of a
batch that already has ``max_num_reqs`` requests (``query_start_loc[R] == num_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from warmcap.contracts import PAD_SLOT_ID, AttentionMetadata
from warmcap.runner_v2.input_batch import StepInputs
from warmcap.runner_v2.slot_mapping import slot_mapping


class StepBuffers:
    """Device buffers for ``max_num_tokens`` tokens and ``max_num_reqs`` requests (plus one spare
    padding row), one block table and slot mapping per KV group (``group_block_sizes``: group name
    -> block size)."""

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        group_block_sizes: Mapping[str, int],
        device: torch.device | str,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        #: rows allocated: every request plus the spare padding row
        self.num_rows = max_num_reqs + 1
        self.max_blocks_per_req = max_blocks_per_req
        self.group_block_sizes = dict(group_block_sizes)
        self.device = torch.device(device)
        rows = self.num_rows
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.query_start_loc = torch.zeros(rows + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=i32, device=device)
        self.logits_indices = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.block_tables = {
            g: torch.zeros(rows, max_blocks_per_req, dtype=i32, device=device) for g in group_block_sizes
        }
        self.slot_mappings = {
            g: torch.full((max_num_tokens,), PAD_SLOT_ID, dtype=i64, device=device) for g in group_block_sizes
        }
        # Host mirrors so backends can plan without a device sync.
        self.query_start_loc_cpu = torch.zeros(rows + 1, dtype=i32)
        self.seq_lens_cpu = torch.zeros(rows, dtype=i32)
        self.num_tokens = 0
        self.num_reqs = 0
        self.num_tokens_padded = 0
        self.num_reqs_padded = 0
        self.num_logits = 0
        self.max_query_len = 0
        self.max_seq_len = 0

    def copy_from(
        self,
        step: StepInputs,
        *,
        num_tokens_padded: int | None = None,
        num_reqs_padded: int | None = None,
    ) -> None:
        """Load a step, padded to ``num_tokens_padded`` tokens and ``num_reqs_padded`` rows (default:
        no padding), then compute every group's slot mapping on the device."""
        self.load_layout(
            query_start_loc=step.query_start_loc,
            positions=step.positions,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            num_tokens_padded=num_tokens_padded,
            num_reqs_padded=num_reqs_padded,
        )
        t, tp = self.num_tokens, self.num_tokens_padded
        nb = self.device.type == "cuda"
        self.input_ids[:t].copy_(torch.from_numpy(step.input_ids), non_blocking=nb)
        self.input_ids[t:tp].zero_()
        n = len(step.logits_indices)
        self.logits_indices[:n].copy_(torch.from_numpy(step.logits_indices), non_blocking=nb)
        self.num_logits = n

    def load_layout(
        self,
        *,
        query_start_loc: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: Mapping[str, torch.Tensor],
        num_tokens_padded: int | None = None,
        num_reqs_padded: int | None = None,
    ) -> None:
        """Load everything but the token ids: rows (``query_start_loc`` [R+1], ``seq_lens`` [R],
        host ``block_tables`` [R, W] per group), ``positions`` [T], padding, and the slot mappings.
        Drafter passes use it directly (their token ids are device tensors)."""
        r = len(query_start_loc) - 1
        t = int(query_start_loc[-1])
        tp = t if num_tokens_padded is None else num_tokens_padded
        rp = r if num_reqs_padded is None else num_reqs_padded
        if not (t <= tp <= self.max_num_tokens and r <= self.max_num_reqs and r <= rp <= self.num_rows):
            raise ValueError(
                f"step of {t} tokens / {r} requests padded to {tp} / {rp} does not fit buffers of "
                f"{self.max_num_tokens} tokens / {self.max_num_reqs} requests (+1 padding row)"
            )
        if tp > t and rp == r:
            raise ValueError(
                f"padding {t} -> {tp} tokens needs a padded row to own them (num_reqs_padded > {r})"
            )
        nb = self.device.type == "cuda"
        self.positions[:t].copy_(torch.from_numpy(positions), non_blocking=nb)
        self.positions[t:tp].zero_()

        qsl = self.query_start_loc_cpu
        qsl[: r + 1].copy_(torch.from_numpy(query_start_loc))
        qsl[r + 1 : rp + 1] = tp
        self.seq_lens_cpu[:r].copy_(torch.from_numpy(seq_lens))
        self.seq_lens_cpu[r:rp] = 0
        self.query_start_loc[: rp + 1].copy_(qsl[: rp + 1], non_blocking=nb)
        self.seq_lens[:rp].copy_(self.seq_lens_cpu[:rp], non_blocking=nb)

        for g, table in self.block_tables.items():
            table[:r].copy_(block_tables[g], non_blocking=nb)
            table[r:rp].zero_()
            slot_mapping(
                table[:r],
                self.query_start_loc[: r + 1],
                self.positions[:t],
                self.group_block_sizes[g],
                self.slot_mappings[g][:tp],
            )
        query_lens = np.diff(query_start_loc)
        self.num_tokens, self.num_reqs = t, r
        self.num_tokens_padded, self.num_reqs_padded = tp, rp
        self.num_logits = 0
        self.max_query_len = max(int(query_lens.max(initial=0)), tp - t)
        self.max_seq_len = int(np.max(seq_lens, initial=0))

    def attn_metadata(self, *, num_columns: int | None = None) -> dict[str, AttentionMetadata]:
        """Per-group metadata over the loaded (padded) step. ``num_columns`` trims the block tables
        to the columns the step uses (eager only: a graph needs the full static width)."""
        tp, rp = self.num_tokens_padded, self.num_reqs_padded
        cols = self.max_blocks_per_req if num_columns is None else num_columns
        return {
            g: AttentionMetadata(
                num_tokens=tp,
                num_reqs=rp,
                query_start_loc=self.query_start_loc[: rp + 1],
                seq_lens=self.seq_lens[:rp],
                block_table=self.block_tables[g][:rp, :cols],
                slot_mapping=self.slot_mappings[g][:tp],
                max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len,
                block_size=bs,
                query_start_loc_cpu=self.query_start_loc_cpu[: rp + 1],
                seq_lens_cpu=self.seq_lens_cpu[:rp],
            )
            for g, bs in self.group_block_sizes.items()
        }
