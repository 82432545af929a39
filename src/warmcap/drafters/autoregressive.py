"""The autoregressive drafting loop shared by draft_model and the hidden-state heads (EAGLE,
EAGLE-3, MTP): one ragged prefill over each request's new real tokens, then k - 1 single-token
steps, each fed the previous step's draft.

What differs per method is the strategy a subclass supplies: the prefill's spans, tokens and
features (:meth:`AutoregressiveDrafter.prefill_inputs`), where draft i's step sits relative to the
sampled token (``step_offset``) and what a step reads besides its draft token
(:meth:`step_features`); and the model it runs (``draft_model``), whose ``greedy_drafts`` turns an
output row into a draft token. Drafts stay on the device: each step's column is written into one
``[R, k]`` tensor by device indexing, with row counts known on the host.
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
)
from warmcap.drafters.paged import DraftContext, DraftPass, DraftTokens, num_drafts_allowed
from warmcap.runner_v2.collaborators import DraftModel


class AutoregressiveDrafter(BaseDrafter):
    """k sequential passes per engine step over the drafter's own paged KV groups."""

    #: draft i (i = 1 .. k-1) is fed at position ``P + i + step_offset``, ``P`` the sampled token's
    step_offset: ClassVar[int]
    draft_model: DraftModel

    @abstractmethod
    def prefill_inputs(self, ctx: DraftContext) -> tuple[DraftPass, torch.Tensor, torch.Tensor | None]:
        """The first pass of a step: its spans (one per request of ``ctx.view``), token ids and
        hidden-state features (None when the pass reads tokens only). Its last output row per
        request drafts token 1."""

    def step_features(self, output: torch.Tensor) -> torch.Tensor | None:
        """What the next step reads besides its draft token, given this pass's rows of the
        requests still drafting: nothing by default."""
        return None

    def propose(self, ctx: DraftContext) -> DraftTokens:
        view = ctx.view
        device = ctx.device
        if not view.req_ids:
            return DraftTokens.none(device)
        run, model = self.executor.run, self.draft_model
        budget = num_drafts_allowed(view, self.num_speculative_tokens, ctx.max_model_len)
        prefill, input_ids, features = self.prefill_inputs(ctx)
        out = run(
            prefill, phase=DRAFT_PREFILL, log_phase=DRAFT_PREFILL, input_ids=input_ids, features=features
        )
        # The prefill writes every request's new tokens; only those with budget left draft.
        drafting = np.flatnonzero(budget > 0)
        if drafting.size == 0:
            return DraftTokens.none(device)
        out = out[torch.from_numpy(prefill.last_token_index()[drafting]).to(device)]
        draft = model.greedy_drafts(DRAFT_PREFILL, out)
        tokens = torch.full(
            (drafting.size, self.num_speculative_tokens), -1, dtype=torch.int64, device=device
        )
        tokens[:, 0] = draft
        # ``active``: the view's requests still drafting; ``alive``: their rows of ``tokens``.
        active, alive = drafting, np.arange(drafting.size)
        for i in range(1, self.num_speculative_tokens):
            keep = budget[active] > i
            if not keep.any():
                break
            mask = torch.from_numpy(keep).to(device)
            active, alive, out, draft = active[keep], alive[keep], out[mask], draft[mask]
            step = DraftPass.spans(
                [view.req_ids[j] for j in active],
                view.rows[active],
                view.next_position[active] + i + self.step_offset,
                np.ones(active.size, dtype=np.int64),
            )
            out = run(
                step,
                phase=DRAFT_DECODE,
                log_phase=f"draft_step_{i}",
                input_ids=draft,
                features=self.step_features(out),
            )
            draft = model.greedy_drafts(DRAFT_DECODE, out)
            tokens[torch.from_numpy(alive).to(device), i] = draft
        return DraftTokens.from_rows(
            [view.req_ids[j] for j in drafting], budget[drafting], tokens, view.next_position[drafting] + 1
        )
