"""Drafter passes over the drafter's own KV groups: what the target step left for the drafter,
the spans each pass covers, and the pass itself through the runner.

A drafter never builds block ids or metadata itself: the runner loads each pass into its drafter
buffers from the persistent block tables (rows of ``runner.batch.block_tables[group]`` are the
blocks the KV cache manager reserved for the request in that group, with the same lookahead rule as
the target groups), and records every slot mapping in its write log (invariant I2 covers drafters
too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from warmcap.contracts import ForwardContext
from warmcap.runner_v2.attention.context import StepContext
from warmcap.runner_v2.collaborators import DraftPass

if TYPE_CHECKING:
    import torch

    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.drafters.base import BaseDrafter
    from warmcap.runner_v2.model_runner import ModelRunner

__all__ = ["DraftPass", "StepView", "collect_drafts", "draft_context", "num_drafts_allowed", "run_pass"]


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


def run_pass(
    runner: ModelRunner,
    drafter: BaseDrafter,
    dp: DraftPass,
    *,
    phase: str,
    log_phase: str,
    input_ids: torch.Tensor,
    features: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pass of ``drafter`` (the runner's own) through :meth:`ModelRunner.run_draft_pass`:
    replayed from a captured drafter graph when one fits, else eagerly over the runner's drafter
    buffers; logged under ``log_phase`` while the runner records KV writes."""
    if drafter is not runner.drafter:
        raise RuntimeError(f"{type(drafter).__name__} is not this runner's drafter: pass it to ModelRunner")
    return runner.run_draft_pass(dp, phase=phase, log_phase=log_phase, input_ids=input_ids, features=features)


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
