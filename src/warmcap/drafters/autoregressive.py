"""The autoregressive drafting loop shared by draft_model and the hidden-state heads (EAGLE,
EAGLE-3, MTP): one ragged prefill over each request's new real tokens, then k - 1 single-token
steps, each fed the previous step's draft.

What differs per method is the strategy a subclass supplies: the prefill's spans, tokens and
features (:meth:`AutoregressiveDrafter.prefill_inputs`), where draft i's step sits relative to the
sampled token (``step_offset``), what a step reads besides its draft token (:meth:`step_features`)
and how an output row becomes a draft token (``greedy_drafts``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import numpy as np
import torch

from warmcap.drafters.base import (
    DRAFT_DECODE,
    DRAFT_PREFILL,
    BaseDrafter,
    DraftGraphShape,
    autoregressive_graph_shapes,
)
from warmcap.drafters.paged import DraftContext, DraftPass, collect_drafts, num_drafts_allowed


class AutoregressiveDrafter(BaseDrafter):
    """k sequential passes per engine step over the drafter's own paged KV groups."""

    #: draft i (i = 1 .. k-1) is fed at position ``P + i + step_offset``, ``P`` the sampled token's
    step_offset: ClassVar[int]

    @abstractmethod
    def prefill_inputs(self, ctx: DraftContext) -> tuple[DraftPass, torch.Tensor, torch.Tensor | None]:
        """The first pass of a step: its spans (one per request of ``ctx.view``), token ids and
        hidden-state features (None when the pass reads tokens only). Its last output row per
        request drafts token 1."""

    @abstractmethod
    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor:
        """The draft token of each output row (every pass of this loop drafts)."""

    def step_features(self, output: torch.Tensor) -> torch.Tensor | None:
        """What the next step reads besides its draft token, given this pass's rows of the
        requests still drafting: nothing by default."""
        return None

    def graph_shapes(self) -> list[DraftGraphShape]:
        return autoregressive_graph_shapes(self.num_speculative_tokens)

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        view = ctx.view
        if not view.req_ids:
            return {}
        device = ctx.device
        budget = num_drafts_allowed(view, self.num_speculative_tokens, ctx.max_model_len)
        prefill, input_ids, features = self.prefill_inputs(ctx)
        out = ctx.run_pass(
            prefill,
            phase=DRAFT_PREFILL,
            log_phase=DRAFT_PREFILL,
            input_ids=input_ids,
            features=features,
        )
        # The prefill writes every request's new tokens; only those with budget left draft.
        active = np.flatnonzero(budget > 0)
        if active.size == 0:
            return {}
        out = out[torch.from_numpy(prefill.last_token_index()[active]).to(device)]
        draft = self.greedy_drafts(DRAFT_PREFILL, out)
        drafts = [draft]
        for i in range(1, self.num_speculative_tokens):
            keep = budget[active] > i
            if not keep.any():
                break
            mask = torch.from_numpy(keep).to(device)
            active, out, draft = active[keep], out[mask], draft[mask]
            step = DraftPass.spans(
                [view.req_ids[j] for j in active],
                view.rows[active],
                view.next_position[active] + i + self.step_offset,
                np.ones(active.size, dtype=np.int64),
            )
            out = ctx.run_pass(
                step,
                phase=DRAFT_DECODE,
                log_phase=f"draft_step_{i}",
                input_ids=draft,
                features=self.step_features(out),
            )
            draft = self.greedy_drafts(DRAFT_DECODE, out)
            drafts.append(draft)
        return collect_drafts(view.req_ids, budget, drafts)
