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

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from warmcap.core.kv_spec import KVCacheGroup, MambaSpec
from warmcap.drafters.base import (
    DRAFT_DECODE,
    DRAFT_GROUP_PREFIX,
    DRAFT_PREFILL,
    BaseDrafter,
    DraftGraphShape,
    autoregressive_graph_shapes,
)
from warmcap.drafters.paged import (
    DraftPass,
    StepView,
    collect_drafts,
    draft_context,
    num_drafts_allowed,
    run_pass,
)
from warmcap.kv_layout import layer_specs
from warmcap.runner_v2.mamba_draft_state import draft_row_plans
from warmcap.runner_v2.mamba_state import mamba_metadata

if TYPE_CHECKING:
    from torch import nn

    from warmcap.config import EngineConfig
    from warmcap.core.outputs import SchedulerOutput
    from warmcap.runner_v2.attention.base import AttentionMetadata
    from warmcap.runner_v2.model_runner import ModelRunner


class DraftModelDrafter(BaseDrafter):
    """Greedy drafts from a separate LM whose KV lives in ``draft.``-prefixed groups."""

    method = "draft_model"

    def __init__(self, config: EngineConfig, model: nn.Module) -> None:
        super().__init__(config)
        self.model: Any = model
        self._layer_names: dict[str, str] = {}

    @staticmethod
    def lookahead_for(num_speculative_tokens: int) -> int:
        return num_speculative_tokens

    def kv_groups(self, block_size: int) -> list[KVCacheGroup]:
        specs = layer_specs(self.model, self.config, block_size)
        self._layer_names = {name: DRAFT_GROUP_PREFIX + name for name in specs}
        return self._own_groups(specs)

    def graph_shapes(self) -> list[DraftGraphShape]:
        return autoregressive_graph_shapes(self.num_speculative_tokens)

    def forward_pass(
        self,
        runner: ModelRunner,
        phase: str,
        metas: dict[str, AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx = draft_context(runner, self._groups, self.state_metadata(runner, metas), self._layer_names)
        return self.model.forward(input_ids, positions, ctx)

    def state_metadata(
        self, runner: ModelRunner, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with the state columns of the draft LM's Mamba groups for the pass loaded now
        (eager passes arrive with them; a graph's static entries are refilled in place, see
        :func:`~warmcap.runner_v2.mamba_state.mamba_metadata`). ``static``: ``metas`` belong to a
        graph; keep the returned dict and pass it back on every pass."""
        out = dict(metas)
        for group in self._groups:
            spec = group.spec
            if isinstance(spec, MambaSpec):
                tables, known = runner.batch.block_tables[group.name].table, runner.batch.num_tokens
                plans_of = partial(draft_row_plans, spec, tables=tables, num_known_tokens=known)
                out[group.name] = mamba_metadata(metas[group.name], plans_of, static=static)
        return out

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor:
        return self._draft(output)

    def _run(self, runner: ModelRunner, dp: DraftPass, input_ids: torch.Tensor, phase: str) -> torch.Tensor:
        kind = DRAFT_PREFILL if phase == DRAFT_PREFILL else DRAFT_DECODE
        return run_pass(runner, self, dp, phase=kind, log_phase=phase, input_ids=input_ids)

    def _draft(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def propose(
        self, runner: ModelRunner, sched_out: SchedulerOutput, sampled: Sequence[Sequence[int]]
    ) -> dict[str, list[int]]:
        view = StepView.from_runner(runner, sampled)
        if not view.req_ids:
            return {}
        device = runner.device
        budget = num_drafts_allowed(view, self.num_speculative_tokens, runner.max_model_len)
        lengths = view.num_valid + view.sampled.astype(np.int64)
        prefill = DraftPass.spans(view.req_ids, view.rows, view.start, lengths)
        tokens = runner.batch.token_ids[np.repeat(prefill.rows, prefill.query_lens), prefill.positions]
        out = self._run(runner, prefill, torch.from_numpy(tokens).to(device), DRAFT_PREFILL)

        active = np.flatnonzero(budget > 0)
        if active.size == 0:
            return {}
        draft = self._draft(out[torch.from_numpy(prefill.last_token_index()[active]).to(device)])
        drafts = [draft]
        for i in range(1, self.num_speculative_tokens):
            keep = budget[active] > i
            if not keep.any():
                break
            active, draft = active[keep], draft[torch.from_numpy(keep).to(device)]
            dp = DraftPass.spans(
                [view.req_ids[j] for j in active],
                view.rows[active],
                view.next_position[active] + i,
                np.ones(active.size, dtype=np.int64),
            )
            draft = self._draft(self._run(runner, dp, draft, f"draft_step_{i}"))
            drafts.append(draft)
        return collect_drafts(view.req_ids, budget, drafts)
