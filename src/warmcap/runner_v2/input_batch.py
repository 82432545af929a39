"""The persistent batch: request state in fixed rows, updated from each step's deltas.

A request keeps its row from the step it is added until it finishes or is preempted; only what
changed crosses from the scheduler (new blocks, computed count). Host state is numpy so a step's
inputs are built with array ops, never a per-token Python loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from warmcap.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from warmcap.runner_v2.block_table import BlockTables
from warmcap.sampling_params import SamplingParams

#: rows from which :meth:`InputBatch.append_sampled` scatters instead of storing row by row
_SCATTER_MIN_ROWS = 4
#: elements up to which Python's ``all``/``max`` over ``tolist()`` costs less than a numpy
#: reduction (~1.3 us a call however small the array; measured with ``timeit``)
PY_REDUCE_MAX = 32


@dataclass(slots=True)
class StepInputs:
    """Host-side inputs of one step, unpadded, requests in ``req_ids`` order.

    ``logits_indices`` are the token indices that sample: for each request whose computed +
    scheduled tokens reach the end of its known tokens, its last ``num_logits[i]`` tokens
    (1, or 1 + k when verifying k drafts); ``num_logits[i]`` is 0 for a prompt chunk.
    """

    req_ids: list[str]
    rows: np.ndarray  # int64 [R]
    num_scheduled: np.ndarray  # int32 [R]
    query_start_loc: np.ndarray  # int32 [R+1]
    positions: np.ndarray  # int64 [T]
    input_ids: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int32 [R]
    block_tables: dict[str, torch.Tensor]  # group -> int32 [R, max_blocks_per_req]
    logits_indices: np.ndarray  # int64 [N]
    num_logits: np.ndarray  # int32 [R]
    draft_token_ids: list[list[int]]
    max_num_blocks: int
    #: ``block_tables`` as host arrays (the same memory), when the builder has them: loading the
    #: step buffers writes from these without a tensor round trip
    host_block_tables: dict[str, np.ndarray] | None = None
    #: names ``block_tables``' contents: two steps with equal keys have equal tables, so the step
    #: buffers keep the rows they hold (None: unknown, always loaded)
    tables_key: tuple[int, int, int] | None = None
    #: every request runs one token and samples it (the steady decode step)
    decode: bool = False

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def max_query_len(self) -> int:
        return int(self.num_scheduled.max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))


class InputBatch:
    """Request state in ``max_num_reqs`` rows: tokens, progress, sampling settings, block tables."""

    def __init__(
        self,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        group_names: Sequence[str],
        num_speculative_tokens: int = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # Room for drafts and the token sampled after the last position.
        width = max_model_len + num_speculative_tokens + 1
        self.token_ids = np.zeros((max_num_reqs, width), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        # Until a row has min_tokens outputs, its stop tokens (EOS included) cannot be sampled.
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.min_tokens_stop_ids: list[tuple[int, ...]] = [()] * max_num_reqs
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        # Rows whose request returns logprobs: their steps need the full logits.
        self.wants_logprobs = np.zeros(max_num_reqs, dtype=bool)
        # Per row: how many top tokens each prompt position reports (-1: no prompt logprobs).
        self.prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs))
        self.block_tables = BlockTables(group_names, max_num_reqs, max_blocks_per_req)
        #: bumped whenever a row changes hands (a request added or removed): what is worked out per
        #: batch composition (a step's rows, the sampling metadata) is reused until it changes
        self.version = 0
        # The latest step's index: (version, request ids in step order) -> persistent-batch rows;
        # the serial changes with the rows (it names them in ``StepInputs.tables_key``).
        self._index_key: tuple[int, list[str]] = (-1, [])
        self._index_rows = np.zeros(0, dtype=np.int64)
        self._index_serial = 0
        # The latest step's block-table rows, kept while neither the tables nor the rows change:
        # (epoch, index serial) -> (host rows per group, the same as tensors, widest row).
        self._tables_key: tuple[int, int] = (-1, -1)
        self._tables: tuple[dict[str, np.ndarray], dict[str, torch.Tensor], int] = ({}, {}, 0)
        # Per batch size, the layout arrays every decode step of that size shares.
        self._decode_layouts: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        # Rows whose settings may shape the logits (a penalty or min_tokens) and rows returning
        # logprobs: with none in the batch (the common case) a step skips both checks.
        self._shaping_rows: set[int] = set()
        self._logprob_rows: set[int] = set()
        self._prompt_logprob_rows: set[int] = set()

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    # ---- deltas -------------------------------------------------------------------------------

    def update(self, sched_out: SchedulerOutput) -> None:
        """Apply one step's deltas: drop finished/preempted rows, add new requests, append blocks,
        and stage the drafts to verify after each request's known tokens."""
        for req_id in sched_out.finished_req_ids | sched_out.preempted_req_ids:
            if req_id in self.row_of:
                self.remove_request(req_id)
        for new in sched_out.scheduled_new_reqs:
            self.add_request(new)
        # NOTE: one scalar store per running request: the scheduler hands a Python record per
        # request anyway, and converting its values to an array for one scatter costs more than the
        # stores below for any batch this runner serves (measured, benchmarks/bench_host_step.py).
        row_of, computed, append = self.row_of, self.num_computed, self.block_tables.append
        for c in sched_out.scheduled_cached_reqs:
            row = row_of[c.req_id]
            computed[row] = c.num_computed_tokens
            if any(c.new_block_ids.values()):
                append(row, c.new_block_ids)
        for req_id, drafts in sched_out.scheduled_spec_decode_tokens.items():
            if drafts:
                row = self.row_of[req_id]
                start = int(self.num_tokens[row])
                self.token_ids[row, start : start + len(drafts)] = drafts

    def clamp_computed(self, cached: Sequence[CachedRequestData]) -> None:
        """Async scheduling: a running request's computed count is the scheduler's optimistic one
        (every draft of the step in flight accepted); the true count is every known token but the
        last, which this batch knows once that step's tokens are in. A prompt chunk's count is
        already exact (below that bound)."""
        row_of, computed, num_tokens = self.row_of, self.num_computed, self.num_tokens
        for c in cached:
            row = row_of[c.req_id]
            known = num_tokens[row] - 1
            if computed[row] > known:
                computed[row] = known

    def add_request(self, new: NewRequestData) -> int:
        """Place a new (or resumed) request in the lowest free row and return the row."""
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in row {self.row_of[new.req_id]}")
        if not self._free_rows:
            raise RuntimeError(
                f"persistent batch full ({self.max_num_reqs} rows): scheduler exceeded max_num_seqs"
            )
        row = heapq.heappop(self._free_rows)
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed[row] = new.num_computed_tokens
        self._set_sampling(row, new.sampling_params)
        self.block_tables.add_row(row, new.block_ids)
        self.req_ids[row] = new.req_id
        self.row_of[new.req_id] = row
        self.version += 1
        return row

    def update_request(self, cached: CachedRequestData) -> None:
        row = self.row_of[cached.req_id]
        self.num_computed[row] = cached.num_computed_tokens
        self.block_tables.append(row, cached.new_block_ids)

    def remove_request(self, req_id: str) -> int:
        """Free the request's row: clear its block tables and settings; returns the row."""
        row = self.row_of.pop(req_id)
        self.req_ids[row] = None
        self.block_tables.clear_row(row)
        # NOTE: the whole row: staged drafts that were rejected sit past num_tokens.
        self.token_ids[row] = 0
        self.num_tokens[row] = 0
        self.num_prompt_tokens[row] = 0
        self.num_computed[row] = 0
        self.generators[row] = None
        self.min_tokens[row] = 0
        self.min_tokens_stop_ids[row] = ()
        self.repetition_penalty[row] = 1.0
        self.presence_penalty[row] = 0.0
        self.frequency_penalty[row] = 0.0
        self.wants_logprobs[row] = False
        self.prompt_logprobs[row] = -1
        self._shaping_rows.discard(row)
        self._logprob_rows.discard(row)
        self._prompt_logprob_rows.discard(row)
        heapq.heappush(self._free_rows, row)
        self.version += 1
        return row

    def append_tokens(self, req_id: str, tokens: Sequence[int]) -> None:
        """Record tokens the runner produced (accepted drafts + the sampled one)."""
        if not tokens:
            return
        row = self.row_of[req_id]
        start = int(self.num_tokens[row])
        self.token_ids[row, start : start + len(tokens)] = tokens
        self.num_tokens[row] = start + len(tokens)

    def append_sampled(self, rows: np.ndarray, sampled: Sequence[Sequence[int]]) -> None:
        """:meth:`append_tokens` for a whole step at once: ``sampled[i]`` after row ``rows[i]``'s
        known tokens (one scatter; a decode step appends one token a row)."""
        if len(rows) < _SCATTER_MIN_ROWS:
            # A few rows: scalar stores cost less than setting up the fancy-indexed scatter.
            for row, tokens in zip(rows.tolist(), sampled, strict=True):
                if tokens:
                    start = int(self.num_tokens[row])
                    self.token_ids[row, start : start + len(tokens)] = tokens
                    self.num_tokens[row] = start + len(tokens)
            return
        try:
            # Every row the same number of tokens (a decode step: one each): one [R, k] block.
            block = np.array(sampled, dtype=np.int64)
        except ValueError:  # ragged: rows accepted different numbers of drafts
            block = None
        if block is not None and block.ndim == 2:
            k = block.shape[1]
            if k:
                start = self.num_tokens[rows]
                if k == 1:
                    self.token_ids[rows, start] = block[:, 0]
                else:
                    self.token_ids[rows[:, None], start[:, None] + np.arange(k)] = block
                self.num_tokens[rows] = start + k
            return
        lens = np.fromiter(map(len, sampled), dtype=np.int64, count=len(sampled))
        flat = np.fromiter(chain.from_iterable(sampled), dtype=np.int64, count=int(lens.sum()))
        if len(flat) == 0:
            return
        ends = np.cumsum(lens)
        owners = np.repeat(rows, lens)
        offsets = np.arange(len(flat)) - np.repeat(ends - lens, lens)
        self.token_ids[owners, self.num_tokens[owners] + offsets] = flat
        self.num_tokens[rows] += lens.astype(np.int32)

    def reserve_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Async scheduling: one token each ``rows`` sampled that is still on the device. Each row
        grows by a placeholder (-1) the next step's inputs take from the device, and
        :meth:`fill_tokens` replaces once read; returns where each went."""
        positions = self.num_tokens[rows].astype(np.int64)
        self.token_ids[rows, positions] = -1
        self.num_tokens[rows] += 1
        return positions

    def fill_tokens(self, rows: np.ndarray, positions: np.ndarray, tokens: Sequence[int]) -> None:
        """The reserved tokens of :meth:`reserve_tokens`, read."""
        self.token_ids[rows, positions] = tokens

    def _set_sampling(self, row: int, params: SamplingParams) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        self.min_tokens_stop_ids[row] = params.all_stop_token_ids
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.wants_logprobs[row] = params.logprobs is not None
        self.prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        shaping = params.min_tokens > 0 or params.repetition_penalty != 1.0
        if shaping or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self._shaping_rows.add(row)
        if params.logprobs is not None:
            self._logprob_rows.add(row)
        if params.prompt_logprobs is not None:
            self._prompt_logprob_rows.add(row)
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator()
            gen.manual_seed(params.seed)
        self.generators[row] = gen

    def process_logits(self, logits: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """``logits`` (rows as ``step.logits_indices``) as the requests' settings shape them before
        sampling: penalties, then stop tokens held back until ``min_tokens``.

        The j-th logits row of a request samples its output token ``done + j`` (``done`` = outputs
        so far), after the prompt, those outputs and its first j staged drafts.
        """
        if not self._shaping_rows:
            return logits
        rows = step.rows
        done = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        penalized, held = self._shaped(rows, done)
        if not (penalized | held).any():
            return logits
        logits = logits.clone()
        first = 0
        for i, (row, n) in enumerate(zip(rows.tolist(), step.num_logits.tolist(), strict=True)):
            for j in range(n if penalized[i] else 0):
                self._penalize(logits[first + j], row, int(self.num_tokens[row]) + j)
            stop_ids = self.min_tokens_stop_ids[row]
            num_held = min(max(int(self.min_tokens[row]) - int(done[i]), 0), n)
            if num_held and stop_ids:
                logits[first : first + num_held, list(stop_ids)] = float("-inf")
            first += n
        return logits

    @property
    def may_shape_logits(self) -> bool:
        """Whether any row has a setting that may shape its logits (a penalty or ``min_tokens``),
        reading its token ids on the host."""
        return bool(self._shaping_rows)

    def shapes_logits(self, step: StepInputs) -> bool:
        """Whether :meth:`process_logits` would change this step's logits (a penalty, or a stop
        token held back by ``min_tokens``)."""
        if not self._shaping_rows:
            return False
        rows = step.rows
        penalized, held = self._shaped(rows, self.num_tokens[rows] - self.num_prompt_tokens[rows])
        return bool((penalized | held).any())

    @property
    def may_want_prompt_logprobs(self) -> bool:
        """Whether any row's request asked for prompt logprobs."""
        return bool(self._prompt_logprob_rows)

    def wants_logprobs_in(self, rows: np.ndarray) -> bool:
        """Whether any of ``rows`` returns logprobs (so its step needs the full logits)."""
        return bool(self._logprob_rows) and bool(self.wants_logprobs[rows].any())

    def _shaped(self, rows: np.ndarray, done: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row of ``rows``: whether a penalty applies, whether ``min_tokens`` holds stops back."""
        penalized = (self.repetition_penalty[rows] != 1) | (self.presence_penalty[rows] != 0)
        penalized |= self.frequency_penalty[rows] != 0
        return penalized, self.min_tokens[rows] > done

    def _penalize(self, logits: torch.Tensor, row: int, end: int) -> None:
        """vLLM's penalties on one logits row, in place, given the row's first ``end`` tokens."""
        seen = torch.from_numpy(self.token_ids[row, :end]).to(logits.device)
        rep = float(self.repetition_penalty[row])
        if rep != 1.0:
            ids = seen.unique()
            vals = logits[ids]
            logits[ids] = torch.where(vals > 0, vals / rep, vals * rep)
        presence, frequency = float(self.presence_penalty[row]), float(self.frequency_penalty[row])
        if presence or frequency:
            counts = torch.bincount(seen[int(self.num_prompt_tokens[row]) :], minlength=logits.shape[0])
            logits -= frequency * counts[: logits.shape[0]] + presence * (counts[: logits.shape[0]] > 0)

    # ---- one step's inputs ---------------------------------------------------------------------

    def prepare_inputs(self, sched_out: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests (in ``sched_out.num_scheduled_tokens`` order) into token
        ids, positions, query offsets, context lengths, block tables and sampling indices.

        Built from the step's index (the scheduled rows and their token counts) by array ops over
        the persistent state; the rows are looked up again only when the scheduled requests or
        the batch's composition changed. A decode step (one token a request, no drafts) takes the
        short path: no repeats, every request samples its one token.
        """
        sched = sched_out.num_scheduled_tokens
        req_ids = list(sched)
        r = len(req_ids)
        key_version, key_ids = self._index_key
        if key_version == self.version and key_ids == req_ids:
            rows = self._index_rows
        else:
            row_of = self.row_of
            rows = np.fromiter((row_of[i] for i in req_ids), dtype=np.int64, count=r)
            self._index_key, self._index_rows = (self.version, req_ids), rows
            self._index_serial += 1
        computed = self.num_computed[rows]
        spec = sched_out.scheduled_spec_decode_tokens
        # A Python sum: for the few requests of a step it costs less than building an array first.
        total = sum(sched.values())
        decode = False
        if total == r and not any(spec.values()):
            # Decode: token i is request i's, at its computed length; it samples when that token
            # is the last known one (always, outside warmup's prompt-chunk steps).
            positions = computed.astype(np.int64)
            seq_lens = computed + 1
            input_ids = self.token_ids[rows, positions]
            samples = seq_lens >= self.num_tokens[rows]
            num_scheduled, qsl, logits_indices, num_logits = self._decode_layout(r)
            if all(samples.tolist()) if r <= PY_REDUCE_MAX else samples.all():
                decode = True
            else:
                num_logits = samples.astype(np.int32)
                logits_indices = np.flatnonzero(samples).astype(np.int64)
            drafts: list[list[int]] = [[] for _ in range(r)]
        else:
            num_scheduled = np.fromiter(sched.values(), dtype=np.int32, count=r)
            qsl = np.zeros(r + 1, dtype=np.int32)
            np.cumsum(num_scheduled, out=qsl[1:])
            offsets = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1], num_scheduled)
            positions = np.repeat(computed, num_scheduled).astype(np.int64) + offsets
            input_ids = self.token_ids[np.repeat(rows, num_scheduled), positions]
            seq_lens = computed + num_scheduled
            drafts = [spec.get(i, []) for i in req_ids]
            num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int32, count=r)
            samples = seq_lens >= self.num_tokens[rows] + num_drafts
            num_logits = np.where(samples, 1 + num_drafts, 0).astype(np.int32)
            logits_indices = _ranges_ending_at(qsl[1:], num_logits)

        tables_key = (self.block_tables.epoch, self._index_serial)
        if tables_key != self._tables_key:
            # Gathered again only when a request's blocks or the step's rows changed: the arrays
            # of an earlier step stay as they were (later steps build new ones, never write them).
            host = {g: t.table[rows] for g, t in self.block_tables.tables.items()}
            self._tables = (
                host,
                {g: torch.from_numpy(t) for g, t in host.items()},
                self.block_tables.max_num_blocks(rows),
            )
            self._tables_key = tables_key
        host_tables, tables, max_num_blocks = self._tables
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            num_scheduled=num_scheduled,
            query_start_loc=qsl,
            positions=positions,
            input_ids=input_ids,
            seq_lens=seq_lens.astype(np.int32, copy=False),
            block_tables=tables,
            logits_indices=logits_indices,
            num_logits=num_logits,
            draft_token_ids=drafts,
            max_num_blocks=max_num_blocks,
            host_block_tables=host_tables,
            tables_key=(id(self), *tables_key),
            decode=decode,
        )

    def _decode_layout(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(num_scheduled, query_start_loc, logits_indices, num_logits)`` of a decode step of
        ``r`` requests: built once per size and shared by every such step.

        NOTE: shared, so never written (nothing in the runner writes a step's arrays); not flagged
        read-only because ``torch.from_numpy`` warns on such arrays and callers wrap them."""
        layout = self._decode_layouts.get(r)
        if layout is None:
            layout = (
                np.ones(r, dtype=np.int32),
                np.arange(r + 1, dtype=np.int32),
                np.arange(r, dtype=np.int64),
                np.ones(r, dtype=np.int32),
            )
            self._decode_layouts[r] = layout
        return layout


def _ranges_ending_at(ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``range(end - n, end)`` for each pair, as int64."""
    total = int(lengths.sum())
    starts = np.repeat(ends.astype(np.int64) - lengths, lengths)
    firsts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return starts + (np.arange(total, dtype=np.int64) - firsts)
