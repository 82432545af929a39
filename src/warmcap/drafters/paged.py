"""Drafter passes over the drafter's own KV groups: metadata from the persistent block tables, and
every slot mapping recorded in the runner's write log (invariant I2 covers drafters too).

A drafter never builds block ids itself: rows of ``runner.batch.block_tables[group]`` are the blocks
the KV cache manager reserved for the request in that group (with the same lookahead rule as the
target groups), and the slot of position ``p`` is derived from them exactly as for the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.contracts import AttentionMetadata, ForwardContext
from warmcap.core.kv_spec import MambaSpec
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.kv_writes import KVWriteRecord
from warmcap.runner_v2.mamba_draft_state import draft_state_metadata
from warmcap.runner_v2.mamba_state import state_write_slots
from warmcap.runner_v2.slot_mapping import slot_mapping

if TYPE_CHECKING:
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.drafters.base import Drafter
    from warmcap.runner_v2.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class StepView:
    """What the target step left for the drafter, per scheduled request (step order).

    - ``start``: the first position computed this step (``num_computed_tokens`` before the step)
    - ``num_valid``: positions ``start .. start + num_valid - 1`` hold target states of real tokens
      (scheduled tokens minus rejected drafts)
    - ``sampled``: whether a token was sampled; it sits at position ``start + num_valid``
    - ``token_offset``: index of position ``start`` in the target's hidden states
    """

    req_ids: list[str]
    rows: np.ndarray
    start: np.ndarray
    num_valid: np.ndarray
    sampled: np.ndarray
    token_offset: np.ndarray

    @classmethod
    def from_runner(cls, runner: ModelRunner, sampled: Sequence[Sequence[int]]) -> StepView:
        step = runner.last_step
        if step is None:
            raise RuntimeError("the drafter ran before any target step")
        qsl = step.query_start_loc
        start = step.positions[qsl[:-1]] if step.num_tokens else np.zeros(0, dtype=np.int64)
        num_drafts = np.fromiter((len(d) for d in step.draft_token_ids), dtype=np.int64, count=step.num_reqs)
        num_out = np.fromiter((len(s) for s in sampled), dtype=np.int64, count=step.num_reqs)
        accepted = np.maximum(num_out - 1, 0)
        # A request that sampled keeps its accepted drafts; one that did not had no drafts.
        num_valid = step.num_scheduled.astype(np.int64) - np.where(num_out > 0, num_drafts - accepted, 0)
        return cls(
            req_ids=list(step.req_ids),
            rows=step.rows.astype(np.int64),
            start=start.astype(np.int64),
            num_valid=num_valid,
            sampled=num_out > 0,
            token_offset=qsl[:-1].astype(np.int64),
        )

    @property
    def next_position(self) -> np.ndarray:
        """Position of the token sampled this step (meaningful where ``sampled``)."""
        return self.start + self.num_valid

    def valid_state_index(self) -> np.ndarray:
        """Row of the target's step hidden states for each valid position, requests in order."""
        firsts = np.cumsum(self.num_valid) - self.num_valid
        within = np.arange(int(self.num_valid.sum())) - np.repeat(firsts, self.num_valid)
        return np.repeat(self.token_offset, self.num_valid) + within


def num_drafts_allowed(view: StepView, k: int, max_model_len: int) -> np.ndarray:
    """Draft count per request: ``k``, cut so no draft lands at or past ``max_model_len - 1``
    (the scheduler never schedules past it, and the drafter must not write past the cap of the
    reservation rule), and 0 for requests that sampled nothing."""
    room = max_model_len - 1 - view.next_position
    return np.where(view.sampled, np.clip(room, 0, k), 0)


@dataclass(slots=True)
class DraftPass:
    """One drafter forward over ragged per-request position spans."""

    req_ids: list[str]
    rows: np.ndarray  # int64 [R] persistent-batch rows
    query_start_loc: np.ndarray  # int32 [R + 1]
    positions: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int32 [R]: last position written + 1

    @classmethod
    def spans(
        cls, req_ids: Sequence[str], rows: np.ndarray, first: np.ndarray, lengths: np.ndarray
    ) -> DraftPass:
        """Request ``i`` queries positions ``first[i] .. first[i] + lengths[i] - 1``; requests with
        no positions are dropped."""
        keep = np.flatnonzero(lengths > 0)
        lengths = lengths[keep].astype(np.int64)
        first = first[keep].astype(np.int64)
        qsl = np.zeros(len(keep) + 1, dtype=np.int32)
        np.cumsum(lengths, out=qsl[1:])
        total = int(qsl[-1])
        offsets = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1].astype(np.int64), lengths)
        positions = np.repeat(first, lengths) + offsets
        return cls(
            req_ids=[req_ids[i] for i in keep.tolist()],
            rows=rows[keep],
            query_start_loc=qsl,
            positions=positions,
            seq_lens=(first + lengths).astype(np.int32),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def query_lens(self) -> np.ndarray:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).astype(np.int64)

    def last_token_index(self) -> np.ndarray:
        """Index, within the pass, of each request's last query token."""
        return self.query_start_loc[1:].astype(np.int64) - 1


def build_metadata(
    runner: ModelRunner, groups: Sequence[KVCacheGroup], dp: DraftPass, *, phase: str
) -> dict[str, AttentionMetadata]:
    """Metadata (slot mappings included) of the drafter's groups for ``dp``, recorded in the
    runner's KV write log under ``phase`` when recording is on."""
    metas: dict[str, AttentionMetadata] = {}
    # NOTE: built outside inference mode: attention backends key cached plans on tensor versions,
    # which inference tensors do not track.
    with torch.inference_mode(False):
        device = runner.device
        qsl_cpu = torch.from_numpy(dp.query_start_loc.copy())
        seq_cpu = torch.from_numpy(dp.seq_lens.copy())
        qsl = qsl_cpu.to(device)
        seq = seq_cpu.to(device)
        positions = torch.from_numpy(dp.positions.copy()).to(device)
        max_query = int(dp.query_lens.max(initial=0))
        max_seq = int(dp.seq_lens.max(initial=0))
        tables = {g.name: runner.batch.block_tables[g.name].gather(dp.rows).to(device) for g in groups}
        slots = {g.name: torch.empty(dp.num_tokens, dtype=torch.int64, device=device) for g in groups}
        for group in groups:
            slot_mapping(tables[group.name], qsl, positions, group.spec.block_size, slots[group.name])
    for group in groups:
        table = runner.batch.block_tables[group.name]
        metas[group.name] = AttentionMetadata(
            num_tokens=dp.num_tokens,
            num_reqs=dp.num_reqs,
            query_start_loc=qsl,
            seq_lens=seq,
            block_table=tables[group.name],
            slot_mapping=slots[group.name],
            max_query_len=max_query,
            max_seq_len=max_seq,
            block_size=group.spec.block_size,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        record = (torch.from_numpy(dp.positions.copy()), slots[group.name].cpu().clone())
        if isinstance(group.spec, MambaSpec):
            # A draft LM's Mamba layers keep state columns; the audit sees their state writes.
            rows, known = runner.batch.block_tables[group.name].table, runner.batch.num_tokens
            metas[group.name], plans = draft_state_metadata(group.spec, metas[group.name], rows, known)
            record = state_write_slots(metas[group.name], plans)
        if runner.record_kv_writes:
            runner.kv_write_log.add(
                KVWriteRecord(
                    phase=phase,
                    group=group.name,
                    req_ids=list(dp.req_ids),
                    query_start_loc=dp.query_start_loc.tolist(),
                    positions=record[0],
                    slot_mapping=record[1],
                    step=runner.num_steps,
                    block_ids={r: table.row(int(row)) for r, row in zip(dp.req_ids, dp.rows, strict=True)},
                )
            )
    return metas


def run_pass(
    runner: ModelRunner,
    drafter: Drafter,
    dp: DraftPass,
    *,
    phase: str,
    log_phase: str,
    input_ids: torch.Tensor,
    features: torch.Tensor | None = None,
) -> torch.Tensor:
    """One drafter pass (``phase`` ``draft_prefill`` or ``draft_decode``) over ``dp``: replayed
    from a captured drafter graph when ``runner.graph_runner`` has one that fits, else run eagerly
    over metadata built for ``dp``. Either way its slot mappings are logged under ``log_phase``
    when recording is on."""
    graphs = getattr(runner, "graph_runner", None)
    if graphs is not None:
        out = graphs.draft_forward(drafter, phase, dp, input_ids, features, log_phase)
        if out is not None:
            return out
    metas = build_metadata(runner, drafter.graph_groups(), dp, phase=log_phase)
    positions = torch.from_numpy(dp.positions).to(runner.device)
    return drafter.forward_pass(runner, phase, metas, input_ids, positions, features)


def draft_context(
    runner: ModelRunner,
    groups: Sequence[KVCacheGroup],
    metas: dict[str, AttentionMetadata],
    layer_names: dict[str, str],
) -> ForwardContext:
    """A forward context in which the drafter module's layer ``name`` uses the runner's cache of
    ``layer_names[name]`` (the ``draft.``-prefixed layer of a drafter group)."""
    group_of = {layer: g.name for g in groups for layer in g.layer_names}
    return StepContext(
        attn_metadata=metas,
        layer_to_group={name: group_of[full] for name, full in layer_names.items()},
        kv_caches={name: runner.kv_caches.tensors[full] for name, full in layer_names.items()},
        backends=runner.backends,
        group_kinds={g.name: g.spec.kind for g in groups},
    )


def collect_drafts(
    req_ids: list[str], budget: np.ndarray, drafts: list[torch.Tensor]
) -> dict[str, list[int]]:
    """Per-step draft tensors (each over the requests still drafting) -> draft lists per request."""
    columns = [d.tolist() for d in drafts]
    out: dict[str, list[int]] = {}
    order = [i for i in range(len(req_ids)) if budget[i] > 0]
    for step, column in enumerate(columns):
        alive = [i for i in order if budget[i] > step]
        for i, tok in zip(alive, column, strict=True):
            out.setdefault(req_ids[i], []).append(int(tok))
    return out
