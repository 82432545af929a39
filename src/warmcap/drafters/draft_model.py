"""An independent causal LM as the drafter (same tokenizer; may be the target checkpoint itself).

Each engine step:

- ``draft_prefill``: the draft LM runs over positions ``start .. P`` with the real tokens (the
  accepted part of what the target computed, plus the token sampled at ``P``); its last output
  drafts token 1. A prompt chunk that samples nothing runs over its chunk only.
- ``draft_step_i`` (i = 1 .. k-1): draft ``i`` at position ``P + i``.

Writes reach at most ``P + k - 1 <= start + scheduled + k - 1``: inside the lookahead k. Rejected
draft positions are rewritten by the next prefill before anything reads them.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from warmcap.core.kv_spec import MambaSpec
from warmcap.drafters.autoregressive import AutoregressiveDrafter
from warmcap.drafters.base import DRAFT_GROUP_PREFIX, PagedDraftModel, autoregressive_graph_shapes
from warmcap.drafters.paged import DraftContext, DraftPass, forward_context
from warmcap.drafters.registry import register
from warmcap.kv_layout import layer_specs
from warmcap.runner_v2.mamba_draft_state import draft_row_plans
from warmcap.runner_v2.mamba_state import mamba_metadata

if TYPE_CHECKING:
    from torch import nn

    from warmcap.config import EngineConfig
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVSpec
    from warmcap.drafters.base import DraftGraphShape
    from warmcap.drafters.paged import DraftKV


class LMDraftModel(PagedDraftModel):
    """A causal LM run over ``draft.``-prefixed KV groups (its Mamba groups' state columns
    included)."""

    def __init__(self, config: EngineConfig, model: nn.Module, shapes: list[DraftGraphShape]) -> None:
        super().__init__(shapes)
        self.config = config
        self.model: Any = model
        self._layer_names: dict[str, str] = {}

    def layer_specs(self, block_size: int) -> dict[str, KVSpec]:
        specs = layer_specs(self.model, self.config, block_size)
        self._layer_names = {name: DRAFT_GROUP_PREFIX + name for name in specs}
        return specs

    def forward_pass(
        self,
        kv: DraftKV,
        phase: str,
        metas: dict[str, AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx = forward_context(kv, self._groups, self.state_metadata(kv, metas), self._layer_names)
        return self.model.forward(input_ids, positions, ctx)

    def state_metadata(
        self, kv: DraftKV, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with the state columns of the draft LM's Mamba groups for the pass loaded now
        (eager passes arrive with them; a graph's static entries are refilled in place, see
        :func:`~warmcap.runner_v2.mamba_state.mamba_metadata`). ``static``: ``metas`` belong to a
        graph; keep the returned dict and pass it back on every pass."""
        out = dict(metas)
        for group in self._groups:
            spec = group.spec
            if isinstance(spec, MambaSpec):
                tables, known = kv.block_tables[group.name], kv.num_tokens
                plans_of = partial(draft_row_plans, spec, tables=tables, num_known_tokens=known)
                out[group.name] = mamba_metadata(metas[group.name], plans_of, static=static)
        return out

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(output).argmax(dim=-1)


@register
class DraftModelDrafter(AutoregressiveDrafter):
    """Greedy drafts from a separate LM whose KV lives in ``draft.``-prefixed groups."""

    method = "draft_model"
    # Draft i is the token at P + i: the LM reads tokens only, so each sits at its own position.
    step_offset: ClassVar[int] = 0
    draft_model: LMDraftModel

    def __init__(self, config: EngineConfig, model: nn.Module) -> None:
        super().__init__(config)
        #: the draft LM's weights (the model half runs them)
        self.model: Any = model
        self.draft_model = LMDraftModel(
            config, model, autoregressive_graph_shapes(self.num_speculative_tokens)
        )

    def prefill_inputs(self, ctx: DraftContext) -> tuple[DraftPass, torch.Tensor, None]:
        # The real tokens: the accepted part of what the target computed, plus the sampled token
        # when it drafts (a P/D producer reserves no slot past the scheduled tokens for it).
        view = ctx.view
        lengths = view.num_valid + (view.sampled & (self.num_speculative_tokens > 0)).astype(np.int64)
        prefill = DraftPass.spans(view.req_ids, view.rows, view.start, lengths)
        tokens = ctx.token_ids[np.repeat(prefill.rows, prefill.query_lens), prefill.positions]
        return prefill, torch.from_numpy(tokens).to(ctx.device), None
