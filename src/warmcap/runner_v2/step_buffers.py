"""Static per-step device buffers, sized to the maximum, refilled each step by ``copy_from``.

The eager path uses slices of them; graph capture records over them and replays after a refill.
Padding is explicit and benign: padded tokens get id 0, position 0 and slot PAD (-1); padded rows
get a zero (null-block) table row, ``seq_len`` 0 and no query tokens except the padded ones, which
belong to the first padded row.

The buffers hold one row more than ``max_num_reqs``: the spare row owns the padded tokens of a
batch that already has ``max_num_reqs`` requests (``query_start_loc[R] == num_tokens``).

Loading is written once, in numpy, into each buffer's *host side*: on CPU that is a numpy view of
the buffer itself (no copy at all; a numpy op costs a fraction of a torch op's dispatch, which is
most of a small step's host time), on CUDA a page-locked staging twin, uploaded with one
non-blocking copy per buffer (a copy from pageable memory would wait for the stream). On CUDA the
slot mappings are then computed on the device (the Triton kernel); on CPU by numpy over the views.

The block-table rows persist in the buffers between steps: a step whose ``tables_key`` names the
rows they already hold (same requests in the same order, no block added or freed since) loads no
table and uploads none; the slot mapping reads the rows in place. Likewise a decode step of the
size and padding the buffers last held keeps their query offsets and sampling indices (on CUDA:
two uploads fewer); what a decode step still loads is its positions, token ids and lengths.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from warmcap.contracts import PAD_SLOT_ID, AttentionMetadata
from warmcap.runner_v2.input_batch import PY_REDUCE_MAX, StepInputs
from warmcap.runner_v2.slot_mapping import host_slot_mapping, slot_mapping


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
        # (index, values) the next copy_from writes into input_ids on the device (feed_input_ids)
        self._feed: tuple[torch.Tensor, torch.Tensor] | None = None
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
        #: whether the buffers live apart from the host (CUDA): loads go through pinned staging
        self.staged = self.device.type != "cpu"
        pin = self.staged and torch.cuda.is_available()
        # Host mirrors so backends can plan without a device sync (page-locked where they are also
        # the staging of their device twin).
        self.query_start_loc_cpu = torch.zeros(rows + 1, dtype=i32, pin_memory=pin)
        self.seq_lens_cpu = torch.zeros(rows, dtype=i32, pin_memory=pin)
        # The host side of every buffer a load fills (module docstring).
        if self.staged:
            self._stage_input_ids = torch.zeros(max_num_tokens, dtype=i64, pin_memory=pin)
            self._stage_positions = torch.zeros(max_num_tokens, dtype=i64, pin_memory=pin)
            self._stage_logits = torch.zeros(max_num_tokens, dtype=i64, pin_memory=pin)
            self._stage_tables = {
                g: torch.zeros(rows, max_blocks_per_req, dtype=i32, pin_memory=pin) for g in group_block_sizes
            }
            host_ids, host_pos = self._stage_input_ids.numpy(), self._stage_positions.numpy()
            host_logits = self._stage_logits.numpy()
            host_tables = {g: t.numpy() for g, t in self._stage_tables.items()}
            host_qsl, host_seq = self.query_start_loc_cpu.numpy(), self.seq_lens_cpu.numpy()
        else:
            host_ids, host_pos = self.input_ids.numpy(), self.positions.numpy()
            host_logits = self.logits_indices.numpy()
            host_tables = {g: t.numpy() for g, t in self.block_tables.items()}
            host_qsl, host_seq = self.query_start_loc.numpy(), self.seq_lens.numpy()
            self._slots_np = {g: t.numpy() for g, t in self.slot_mappings.items()}
        self._h_input_ids, self._h_positions, self._h_logits = host_ids, host_pos, host_logits
        self._h_tables, self._h_qsl, self._h_seq_lens = host_tables, host_qsl, host_seq
        self._qsl_cpu = self.query_start_loc_cpu.numpy()
        self._seq_lens_cpu = self.seq_lens_cpu.numpy()
        #: the latest upload from the staging (CUDA): the staging is not rewritten before it is done
        self._uploaded: torch.cuda.Event | None = None
        # What the buffers hold from earlier loads: [block-table rows (the step's ``tables_key``,
        # padded rows, the tables' id), decode layout (rows, padded rows and tokens, the buffer's
        # id)], None where unknown. A list, so a shallow copy of these buffers (graph safety's
        # fakes, which share the host views) shares it: a load through either forgets what the
        # other holds.
        self._held: list[tuple[object, ...] | None] = [None, None]
        #: whether the latest load kept the decode layout (query offsets, sampling indices)
        self._layout_kept = False
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
        no padding), then compute every group's slot mapping."""
        self.load_layout(
            query_start_loc=step.query_start_loc,
            positions=step.positions,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables if step.host_block_tables is None else step.host_block_tables,
            num_tokens_padded=num_tokens_padded,
            num_reqs_padded=num_reqs_padded,
            max_query_len=1 if step.decode else step.max_query_len,
            tables_key=step.tables_key,
            decode=step.decode,
        )
        t, tp = self.num_tokens, self.num_tokens_padded
        n = len(step.logits_indices)
        ids, logits = self._h_input_ids, self._h_logits
        ids[:t] = step.input_ids
        if tp > t:
            ids[t:tp] = 0
        # A kept decode layout: the sampling indices are 0..n-1 already.
        keep = self._layout_kept
        if not keep:
            logits[:n] = step.logits_indices
        if self.staged:
            self.input_ids[:tp].copy_(self._stage_input_ids[:tp], non_blocking=True)
            if not keep:
                self.logits_indices[:n].copy_(self._stage_logits[:n], non_blocking=True)
            self._mark_uploaded()
        feed, self._feed = self._feed, None
        if feed is not None:
            # Token ids still on the device (the previous step's samples, async scheduling).
            self.input_ids.index_copy_(0, *feed)
        self.num_logits = n

    def feed_input_ids(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Have the next :meth:`copy_from` overwrite ``input_ids[index]`` with ``values`` (device
        tensors) after loading the step: token ids the host does not hold yet."""
        self._feed = (index, values)

    def load_layout(
        self,
        *,
        query_start_loc: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: Mapping[str, torch.Tensor | np.ndarray],
        num_tokens_padded: int | None = None,
        num_reqs_padded: int | None = None,
        max_query_len: int | None = None,
        tables_key: object | None = None,
        decode: bool = False,
    ) -> None:
        """Load everything but the token ids: rows (``query_start_loc`` [R+1], ``seq_lens`` [R],
        host ``block_tables`` [R, W] per group), ``positions`` [T], padding, and the slot mappings.
        Drafter passes use it directly (their token ids are device tensors). ``max_query_len``: the
        longest row's tokens when the caller knows it (saves a pass over ``query_start_loc``).
        ``tables_key``: names ``block_tables``' contents (``StepInputs.tables_key``); when the
        buffers hold those rows already, padded alike, they are not loaded again. ``decode``: one
        token a row, each sampled (``StepInputs.decode``): a layout of the size and padding the
        buffers hold already is not loaded again."""
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
        self._wait_for_upload()
        held = self._held
        layout = (r, rp, tp, id(self.query_start_loc)) if decode else None
        keep = layout is not None and held[1] == layout
        held[1] = None
        pos, qsl, seq = self._h_positions, self._h_qsl, self._h_seq_lens
        pos[:t] = positions
        if not keep:
            qsl[: r + 1] = query_start_loc
        seq[:r] = seq_lens
        if tp > t or rp > r:
            # Padding (graphs only): an eager step has none, and writing nothing still costs.
            pos[t:tp] = 0
            if not keep:
                qsl[r + 1 : rp + 1] = tp
            seq[r:rp] = 0
        if self.staged:
            # qsl and seq are the pinned host mirrors themselves: no second host copy.
            self.positions[:tp].copy_(self._stage_positions[:tp], non_blocking=True)
            if not keep:
                self.query_start_loc[: rp + 1].copy_(self.query_start_loc_cpu[: rp + 1], non_blocking=True)
            self.seq_lens[:rp].copy_(self.seq_lens_cpu[:rp], non_blocking=True)
        else:
            if not keep:
                self._qsl_cpu[: rp + 1] = qsl[: rp + 1]
            self._seq_lens_cpu[:rp] = seq[:rp]
        query_lens = None
        if max_query_len is None or max_query_len > 1 or t != r:
            query_lens = np.diff(qsl[: r + 1])
            max_query_len = int(query_lens.max(initial=0))
        # None: one token a row (a decode step), the slot mapping's cheap case.
        lens = None if t == r and max_query_len <= 1 else query_lens
        key = None if tables_key is None else (tables_key, rp, id(self.block_tables))
        load_tables = key is None or held[0] != key
        if load_tables:
            held[0] = None
        for g, host in self._h_tables.items():
            if load_tables:
                rows = block_tables[g]
                host[:r] = rows.numpy() if isinstance(rows, torch.Tensor) else rows
                host[r:rp] = 0
            if self.staged:
                table = self.block_tables[g]
                if load_tables:
                    table[:rp].copy_(self._stage_tables[g][:rp], non_blocking=True)
                slot_mapping(
                    table[:r],
                    self.query_start_loc[: r + 1],
                    self.positions[:t],
                    self.group_block_sizes[g],
                    self.slot_mappings[g][:tp],
                )
            else:
                host_slot_mapping(host[:r], lens, pos[:t], self.group_block_sizes[g], self._slots_np[g][:tp])
        held[0], held[1] = key, layout
        self._layout_kept = keep
        self.num_tokens, self.num_reqs = t, r
        self.num_tokens_padded, self.num_reqs_padded = tp, rp
        self.num_logits = 0
        self.max_query_len = max(max_query_len, tp - t)
        seq_lens_now = seq[:r]
        self.max_seq_len = (
            max(seq_lens_now.tolist(), default=0) if r <= PY_REDUCE_MAX else int(seq_lens_now.max(initial=0))
        )
        if self.staged:
            self._mark_uploaded()

    def _wait_for_upload(self) -> None:
        """Before the staging is rewritten: the copies reading it must have run (a no-op when the
        step's token fetch already waited for the stream, which is every synchronous step)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def _mark_uploaded(self) -> None:
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        self._uploaded = event

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
