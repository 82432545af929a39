"""Where a request's Mamba state lives in its Mamba group's block table, per cache mode.

A Mamba layer keeps one whole state (conv window + SSM state) per block id; its tensor is
``[num_blocks + 1, conv_elems + ssm_elems]`` (last row: the PAD sink), split by
:func:`warmcap.contracts.mamba_layout.state_views`. A step reads the request's live state from one
column and writes the state reached after chosen tokens into other columns; the blocks of both reach
the model as :class:`~warmcap.contracts.metadata.MambaMetadata`. With ``n = c + s - d`` (computed +
scheduled tokens, minus the ``d`` draft tokens of a verify step) the columns are:

- ``none``: states live in columns ``0 .. k`` (vLLM sizes this group's block to ``max_model_len``,
  so a request holds ``1 + k`` blocks). A step writes the state after its last committed token
  to column 0 and the state after draft j to column j.
- ``align`` / ``all``: the anchor is ``block_of(n - 1)``, the block of the last committed token;
  the state after it goes there and the state after draft j to ``anchor + j`` (vLLM gathers
  ``1 + k`` consecutive columns from the last block). A target model's ``align`` group follows
  the reference engine's layout instead (``core/reservation.py`` ``align_step``): its anchor is
  the block of the last *scheduled* token, drafts included, and the running state and the draft
  states fill the last ``1 + k`` columns of the request's table, so the anchor is read off the
  table (:func:`align_anchors`). ``all`` also writes the state at every block
  boundary a step crosses (position ``p`` with ``(p + 1) % block_size == 0``) into ``block_of(p)``,
  so prefix-cache hits on whole blocks find their state; ``align`` leaves that to chunking.
- After verification accepts ``a`` of the ``1 + d`` verified positions (``a >= 1``) the live state
  is column ``anchor + a - 1``; the next step reads it before it writes anything.

NOTE: boundaries crossed only by draft tokens are not written in ``all`` mode: a draft's state may
be rolled back, so a prefix-cache entry must never trust it.

Graphs: a recorded CUDA graph keeps the addresses of the read/write block tensors it saw. Metadata
over a graph's static buffers is therefore *static* (``MambaMetadata.static``): made once, kept by
its owner (the graph's metadata dict), and refilled in place before every pass over it
(:func:`mamba_metadata`), so a replay reads this step's columns. One-off metadata of an eager step
is built fresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from warmcap.contracts.metadata import AttentionMetadata, MambaMetadata
from warmcap.core.kv_spec import KVCacheGroup, MambaSpec
from warmcap.core.reservation import block_of

NO_BLOCK = -1


@dataclass(frozen=True, slots=True)
class StatePlan:
    """One request's state traffic in one step: the column read (None: zero state) and
    ``(token index within the step, column)`` pairs written."""

    read_column: int | None
    writes: tuple[tuple[int, int], ...]


def anchor_column(spec: MambaSpec, num_committed_tokens: int) -> int:
    """Column of the state after the last committed token (``num_committed_tokens >= 1``)."""
    if spec.cache_mode == "none":
        return 0
    return block_of(spec, num_committed_tokens - 1)


def accepted_column(spec: MambaSpec, num_committed_tokens: int, num_accepted: int) -> int:
    """The live column after a step whose last committed token is number ``num_committed_tokens``
    and whose verification accepted ``num_accepted`` (>= 1) of its ``1 + d`` verified positions."""
    if num_accepted < 1 or num_accepted > 1 + spec.num_speculative_blocks:
        raise ValueError(
            f"num_accepted must be in [1, {1 + spec.num_speculative_blocks}]; got {num_accepted}"
        )
    return anchor_column(spec, num_committed_tokens) + num_accepted - 1


def prefix_column(spec: MambaSpec, num_cached_tokens: int) -> int | None:
    """Where a prefix-cache hit of ``num_cached_tokens`` (whole blocks) finds its state; None in
    mode ``none`` (no state is kept per block) or for an empty hit."""
    if spec.cache_mode == "none" or num_cached_tokens == 0:
        return None
    return block_of(spec, num_cached_tokens - 1)


def plan_state(
    spec: MambaSpec,
    *,
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    num_spec_tokens: int,
    live_column: int | None,
    anchor: int | None = None,
) -> StatePlan:
    """The reads and writes of one request in one step (see the module docstring). ``anchor``:
    the column of the state after the last committed token when the layout fixes it elsewhere
    (a target's ``align`` group: :func:`align_anchors`); by default the block of that token."""
    c, s, d = num_computed_tokens, num_scheduled_tokens, num_spec_tokens
    if not 0 <= d < s or d > spec.num_speculative_blocks:
        raise ValueError(
            f"num_spec_tokens must be in [0, min(num_scheduled_tokens - 1, {spec.num_speculative_blocks})]; "
            f"got {d} with {s} scheduled"
        )
    if c > 0 and live_column is None:
        raise ValueError(f"a request with {c} computed tokens needs the column of its live state")
    committed = c + s - d
    writes: dict[int, int] = {}
    if spec.cache_mode == "all":
        for i in range(s - d):
            if (c + i + 1) % spec.block_size == 0:
                writes[i] = block_of(spec, c + i)
    if anchor is None:
        anchor = anchor_column(spec, committed)
    for j in range(1 + d):
        writes[s - d - 1 + j] = anchor + j
    return StatePlan(live_column if c > 0 else None, tuple(sorted(writes.items())))


def _block_at(table: torch.Tensor, row: int, column: int) -> int:
    """``table[row, column]``, or the null block 0 past the table's width.

    NOTE: a column past a request's blocks reads whatever the zero-filled persistent table holds
    there (the null block), as the reference engine's unchecked indexing would; the warmup audit
    reports such writes as past the held blocks instead of this code raising.
    """
    return int(table[row, column]) if column < table.shape[1] else 0


def state_blocks(meta: AttentionMetadata, plans: Sequence[StatePlan]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host ``(read_blocks [R], write_blocks [T])`` of ``plans`` (one per real row, in row order)
    over ``meta``'s block table; padded rows and tokens get -1."""
    table = meta.block_table.cpu()
    qsl = (meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc).cpu()
    read = torch.full((meta.num_reqs,), NO_BLOCK, dtype=torch.int64)
    write = torch.full((meta.num_tokens,), NO_BLOCK, dtype=torch.int64)
    for row, plan in enumerate(plans):
        if plan.read_column is not None:
            read[row] = _block_at(table, row, plan.read_column)
        for index, column in plan.writes:
            write[int(qsl[row]) + index] = _block_at(table, row, column)
    return read, write


def build_mamba_metadata(
    meta: AttentionMetadata, plans: Sequence[StatePlan], *, static: bool = False
) -> MambaMetadata:
    """``meta`` (the Mamba group's step metadata) plus the read/write blocks of ``plans`` (one per
    real row, in row order); padded rows and tokens get -1."""
    device = meta.block_table.device
    fields = {name: getattr(meta, name) for name in AttentionMetadata.__dataclass_fields__}
    # NOTE: normal tensors even under inference mode: static metadata is refilled in place later,
    # which an inference tensor refuses outside inference mode.
    with torch.inference_mode(False):
        read, write = (t.to(device) for t in state_blocks(meta, plans))
    return MambaMetadata(**fields, read_blocks=read, write_blocks=write, static=static)


def stream_capturing() -> bool:
    """Whether a CUDA graph is being recorded on the current stream (never on a CPU-only build)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def mamba_metadata(
    meta: AttentionMetadata,
    plans_of: Callable[[AttentionMetadata], Sequence[StatePlan]],
    *,
    static: bool = False,
) -> AttentionMetadata:
    """The :class:`MambaMetadata` a pass over ``meta`` uses (``plans_of(meta)``: its row plans).

    - static metadata: its read/write blocks refilled in place (same tensors) and returned;
    - other ``MambaMetadata`` (built for this very pass): returned as is;
    - plain metadata: a new ``MambaMetadata``, ``static`` if asked (a graph's metadata, kept by
      its owner and passed back on every pass).

    NOTE: nothing is refilled while a CUDA graph is being recorded: planning reads device tensors
    on the host, which capture forbids. The graph's owner refills before recording and before
    each replay.
    """
    if not isinstance(meta, MambaMetadata):
        return build_mamba_metadata(meta, plans_of(meta), static=static)
    if meta.static and not stream_capturing():
        if meta.read_blocks is None or meta.write_blocks is None:
            raise ValueError("static MambaMetadata without read/write block tensors cannot be refilled")
        read, write = state_blocks(meta, plans_of(meta))
        meta.read_blocks.copy_(read)
        meta.write_blocks.copy_(write)
    return meta


def probe_plan(spec: MambaSpec, num_computed_tokens: int, num_scheduled_tokens: int) -> StatePlan:
    """The plan of a row no tracked request owns (graph verification builds such rows).

    The row is a step of committed tokens only (no drafts) whose live state is where the rule puts
    the state after its context (``anchor_column``): it reads that state (the zero state when it
    starts from zero) and writes what :func:`plan_state` gives such a step.

    NOTE: a probe may run the same step several times (eager, replay, padded eager) and may write
    the very block it reads (mode ``none`` always does): whoever reruns it must put the blocks it
    wrote back before each run (graph verification does), or later runs read another state.
    """
    c = num_computed_tokens
    return plan_state(
        spec,
        num_computed_tokens=c,
        num_scheduled_tokens=num_scheduled_tokens,
        num_spec_tokens=0,
        live_column=anchor_column(spec, c) if c > 0 else None,
    )


def state_write_slots(
    meta: AttentionMetadata, plans: Sequence[StatePlan]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state writes of ``plans`` as an audit record's ``(positions, slot_mapping)``.

    A write of token t into column j of a row is recorded as position ``j * block_size`` and slot
    ``table[row, j] * block_size``: the audit's rule (slot // block_size is the block the request
    holds at column position // block_size) then checks exactly that the state block is held.
    Tokens that write no state are PAD.
    """
    bs = meta.block_size
    table = meta.block_table.cpu().to(torch.int64)
    qsl = (meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc).cpu()
    positions = torch.zeros(meta.num_tokens, dtype=torch.int64)
    slots = torch.full((meta.num_tokens,), NO_BLOCK, dtype=torch.int64)
    for row, plan in enumerate(plans):
        for index, column in plan.writes:
            t = int(qsl[row]) + index
            positions[t] = column * bs
            slots[t] = _block_at(table, row, column) * bs
    return positions, slots


def identity_blocks(table: torch.Tensor) -> list[int]:
    """Each row's last non-null block: the block that tells whose row it is (0: only null blocks,
    a padded row).

    NOTE: not column 0's block: the KV cache manager frees the columns behind a request's live
    state as the reference engine does, column 0 included (``core/group_managers.py``
    ``MambaManager``), while the runner's persistent table only ever appends, so a freed front
    column keeps a stale id that another request may hold by now. The last column is the newest
    block, which the request still holds, and held Mamba blocks are distinct, so it is unique.
    """
    if table.shape[1] == 0:
        return [0] * table.shape[0]
    table = table.cpu()
    width = table.shape[1]
    from_end = (table != 0).flip(1).to(torch.int8).argmax(dim=1, keepdim=True)
    return table.gather(1, width - 1 - from_end).squeeze(1).tolist()


def align_anchors(spec: MambaSpec, table: torch.Tensor) -> list[int]:
    """A target ``align`` group: each row's anchor, the first of the last ``1 + k`` columns it
    holds (``core/reservation.py`` ``align_state_columns``); the table only ever appends and its
    newest column always holds a block, so the last non-null column ends the row (-1: a padded
    row, null blocks only).

    NOTE: read off the table rather than recomputed from this step's tokens: after drafts were
    rejected a step may schedule fewer tokens than an earlier one, and the anchor stays where the
    earlier step put it (the table never shrinks)."""
    if table.shape[1] == 0:
        return [-1] * table.shape[0]
    nonzero = (table.cpu() != 0).to(torch.int8)
    width = table.shape[1]
    anchors = width - 1 - nonzero.flip(1).argmax(dim=1) - spec.num_speculative_blocks
    return torch.where(nonzero.any(dim=1), anchors, torch.full_like(anchors, -1)).tolist()


def row_spans(meta: AttentionMetadata) -> list[tuple[int, int, int]]:
    """``(num_computed, num_scheduled, identity block)`` of every row of ``meta`` (padded included;
    see :func:`identity_blocks`)."""
    qsl = (
        meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc
    ).tolist()
    seq = (meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens).tolist()
    firsts = identity_blocks(meta.block_table)
    return [
        (seq[i] - (qsl[i + 1] - qsl[i]), qsl[i + 1] - qsl[i], int(firsts[i])) for i in range(meta.num_reqs)
    ]


class MambaStates:
    """The live state column of every running request in each target Mamba group, and the step
    metadata that reads and writes it (see the module docstring for the column rule): the runner's
    :class:`~warmcap.contracts.state_handler.StateHandler` for Mamba layers.

    Rows are matched to requests through their last non-null block in the group
    (:func:`identity_blocks`), so any pass over the runner's buffers — eager, graph replay, graph verification —
    gets the right :class:`MambaMetadata`. Rows owned by no running request are probes
    (:func:`probe_plan`); rows holding only null blocks are padding: they read the zero state and
    write nothing.
    """

    def __init__(self, specs: dict[str, MambaSpec]) -> None:
        self.specs = specs
        self._live: dict[str, dict[str, int]] = {}  # req_id -> group -> live column
        self._drafts: dict[str, int] = {}  # req_id -> drafts verified in the current step
        # req_id -> group -> this step's anchor in a target ``align`` group (``align_anchors``)
        self._anchors: dict[str, dict[str, int]] = {}
        self._owner: dict[str, dict[int, str]] = {g: {} for g in specs}  # group -> identity block -> req_id

    @classmethod
    def for_groups(cls, groups: Iterable[KVCacheGroup]) -> MambaStates | None:
        """The handler of the target's Mamba groups among ``groups``; None when there are none
        (drafters track their own groups' columns)."""
        specs = {g.name: g.spec for g in groups if isinstance(g.spec, MambaSpec) and not g.is_drafter}
        return cls(specs) if specs else None

    def handles(self, group: str) -> bool:
        """Whether ``group`` is one of the tracked Mamba groups."""
        return group in self.specs

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop finished or preempted requests (a resumed request recomputes from zero)."""
        for req_id in req_ids:
            self._live.pop(req_id, None)
            self._drafts.pop(req_id, None)
            self._anchors.pop(req_id, None)
        gone = set(req_ids)
        for owners in self._owner.values():
            for block in [b for b, r in owners.items() if r in gone]:
                del owners[block]

    def begin_step(
        self, req_ids: Sequence[str], block_tables: Mapping[str, torch.Tensor], num_drafts: Sequence[int]
    ) -> None:
        """Register the step's requests (step order): their identity blocks and draft counts."""
        for group, owners in self._owner.items():
            firsts = identity_blocks(block_tables[group][: len(req_ids)])
            for req_id, block in zip(req_ids, firsts, strict=True):
                owners[int(block)] = req_id
        for req_id, d in zip(req_ids, num_drafts, strict=True):
            self._drafts[req_id] = int(d)

    def finish_step(
        self, req_ids: Sequence[str], seq_lens: Sequence[int], sampled: Sequence[Sequence[int]]
    ) -> None:
        """After verification: the live column is the state after the last accepted token."""
        for req_id, n, out in zip(req_ids, seq_lens, sampled, strict=True):
            committed = int(n) - self._drafts.get(req_id, 0)
            live = self._live.setdefault(req_id, {})
            anchors = self._anchors.get(req_id, {})
            for group, spec in self.specs.items():
                accepted = max(1, len(out))
                if group in anchors:
                    live[group] = anchors[group] + accepted - 1
                else:
                    live[group] = accepted_column(spec, committed, accepted)

    def plans(self, group: str, meta: AttentionMetadata) -> list[StatePlan]:
        """One plan per row of ``meta`` (padded rows included)."""
        spec = self.specs[group]
        plans = []
        align = spec.cache_mode == "align"
        anchors = align_anchors(spec, meta.block_table) if align else None
        for row, (c, s, first) in enumerate(row_spans(meta)):
            req_id = self._owner[group].get(first)
            if s == 0 or first == 0:
                plans.append(StatePlan(None, ()))
            elif req_id is None:
                plans.append(probe_plan(spec, c, s))
            else:
                live = self._live.get(req_id, {}).get(group)
                if c > 0 and live is None:
                    live = prefix_column(spec, c)
                anchor = None
                if anchors is not None:
                    anchor = anchors[row]
                    self._anchors.setdefault(req_id, {})[group] = anchor
                plans.append(
                    plan_state(
                        spec,
                        num_computed_tokens=c,
                        num_scheduled_tokens=s,
                        num_spec_tokens=self._drafts.get(req_id, 0),
                        live_column=live,
                        anchor=anchor,
                    )
                )
        return plans

    def metadata(
        self, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with every tracked Mamba group's entry as :class:`MambaMetadata` for the step
        loaded now (:func:`mamba_metadata`: static entries are refilled in place). ``static``:
        ``metas`` belong to a graph; keep the returned dict and pass it back on every pass."""
        if not self.specs:
            return metas
        out = dict(metas)
        for group in self.specs:
            if group in metas:
                out[group] = mamba_metadata(metas[group], partial(self.plans, group), static=static)
        return out

    def write_slots(self, group: str, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The audit record of the state writes a pass over ``meta`` makes in ``group``."""
        return state_write_slots(meta, self.plans(group, meta))
