"""Mamba state columns of a draft LM's passes (draft prefill and draft steps).

A draft model with Mamba layers keeps its state in its own ``draft.``-prefixed Mamba groups; its
passes never verify anything, so the columns they read and write follow from positions alone
(:func:`draft_state_plans`). The column rule itself is :mod:`warmcap.runner_v2.mamba_state`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from warmcap.contracts.metadata import MambaMetadata
from warmcap.runner_v2.mamba_state import (
    StatePlan,
    anchor_column,
    build_mamba_metadata,
    identity_blocks,
    plan_state,
    probe_plan,
    row_spans,
)

if TYPE_CHECKING:
    from warmcap.contracts.metadata import AttentionMetadata
    from warmcap.core.kv_spec import MambaSpec


def draft_state_plans(
    spec: MambaSpec, first: Sequence[int], lengths: Sequence[int], num_known_tokens: Sequence[int]
) -> list[StatePlan]:
    """Plans of a drafter pass over a Mamba group, one per row (span ``first .. first + len - 1``).

    A draft LM's pass never verifies anything, so its columns follow from positions alone:

    - a span ending at or before the request's known tokens (the draft prefill) starts from the
      state after ``first - 1``; when it ends at the token just sampled (position ``P``), that
      token is re-fed next step, so the state after ``P - 1`` is the committed one (anchor column)
      and the state after ``P`` goes to ``anchor + 1``;
    - a one-token span past the known tokens is draft step ``i`` at ``P + i``: it reads
      ``anchor + i`` and writes ``anchor + i + 1`` for the next draft step (the last one writes none).
    """
    plans = []
    for c, s, known in zip(first, lengths, num_known_tokens, strict=True):
        c, s, known = int(c), int(s), int(known)
        if c + s <= known:
            d = 1 if c + s == known else 0
            live = anchor_column(spec, c) if c > 0 else None
            plans.append(
                plan_state(
                    spec, num_computed_tokens=c, num_scheduled_tokens=s, num_spec_tokens=d, live_column=live
                )
            )
            continue
        sampled = known - 1
        i = c - sampled
        anchor = anchor_column(spec, sampled)
        writes = ((0, anchor + i + 1),) if i < spec.num_speculative_blocks - 1 else ()
        plans.append(StatePlan(anchor + i, writes))
    return plans


def draft_state_metadata(
    spec: MambaSpec, meta: AttentionMetadata, tables: np.ndarray, num_known_tokens: np.ndarray
) -> tuple[MambaMetadata, list[StatePlan]]:
    """A drafter pass's Mamba metadata and plans (:func:`draft_state_plans`).

    Rows are matched to the persistent batch through their last non-null block
    (:func:`~warmcap.runner_v2.mamba_state.identity_blocks`; ``tables``: the group's persistent
    block table, ``num_known_tokens``: tokens known per persistent row), so the same call serves
    eager passes and graph replays. Padded rows (null blocks only) read the zero state and write
    nothing; rows of no running request are probes (:func:`probe_plan`).
    """
    plans = draft_row_plans(spec, meta, tables, num_known_tokens)
    return build_mamba_metadata(meta, plans), plans


def draft_row_plans(
    spec: MambaSpec, meta: AttentionMetadata, tables: np.ndarray, num_known_tokens: np.ndarray
) -> list[StatePlan]:
    """The plans of :func:`draft_state_metadata`, one per row of ``meta`` (padded rows included)."""
    row_of = {b: r for r, b in enumerate(identity_blocks(torch.from_numpy(np.asarray(tables)))) if b}
    plans = []
    for c, s, first in row_spans(meta):
        row = row_of.get(first)
        if s == 0 or first == 0:
            plans.append(StatePlan(None, ()))
        elif row is None:
            plans.append(probe_plan(spec, c, s))
        else:
            plans.extend(draft_state_plans(spec, [c], [s], [int(num_known_tokens[row])]))
    return plans
