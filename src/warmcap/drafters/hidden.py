"""EAGLE, EAGLE-3 and MTP: drafters fed by the target's hidden states, k autoregressive steps.

Position ``p`` of the drafter pairs the target's state at ``p`` with the token at ``p + 1`` and
predicts the token at ``p + 2``. Each engine step:

- ``draft_prefill``: positions ``start .. start + valid - 1`` (the target states of real tokens this
  step; rejected drafts excluded) with the tokens one to the right; its last output drafts token 1.
- ``draft_step_i`` (i = 1 .. k-1): position ``P + i - 1`` (``P``: the sampled token's position)
  with draft ``i`` and the drafter's own previous output in place of a target state.

Writes reach at most position ``P + k - 2 <= start + scheduled + k - 2``: inside the lookahead k.
Positions written with the drafter's own states are rewritten from target states once accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from warmcap.core.kv_spec import KVCacheGroup
from warmcap.drafters.base import (
    DRAFT_DECODE,
    DRAFT_GROUP_PREFIX,
    DRAFT_PREFILL,
    BaseDrafter,
    DraftGraphShape,
    autoregressive_graph_shapes,
)
from warmcap.drafters.heads import DraftHead
from warmcap.drafters.paged import (
    DraftPass,
    StepView,
    collect_drafts,
    draft_context,
    num_drafts_allowed,
    run_pass,
)

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.core.outputs import SchedulerOutput
    from warmcap.runner_v2.attention.base import AttentionMetadata
    from warmcap.runner_v2.model_runner import ModelRunner


class HiddenStateDrafter(BaseDrafter):
    """Runs a :class:`DraftHead` over the drafter's paged KV group."""

    method: ClassVar[str]

    def __init__(self, config: EngineConfig, head: DraftHead, *, aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__(config)
        self.head = head
        #: target layers whose inputs the head consumes (EAGLE-3), in concatenation order
        self.aux_layers = aux_layers
        self.dtype = next(head.parameters()).dtype

    @staticmethod
    def lookahead_for(num_speculative_tokens: int) -> int:
        return num_speculative_tokens

    def kv_groups(self, block_size: int) -> list[KVCacheGroup]:
        specs = self.head.kv_layer_specs(block_size, self.dtype)
        return self._own_groups(specs)

    def graph_shapes(self) -> list[DraftGraphShape]:
        return autoregressive_graph_shapes(self.num_speculative_tokens)

    def feature_spec(self, phase: str) -> tuple[int, torch.dtype]:
        # The prefill reads target features (EAGLE-3: its aux layers side by side); later steps
        # read the head's own output.
        width = self.head.cfg.hidden_size
        if phase == DRAFT_PREFILL and self.aux_layers:
            width *= len(self.aux_layers)
        return width, self.dtype

    def forward_pass(
        self,
        runner: ModelRunner,
        phase: str,
        metas: dict[str, AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None,
    ) -> torch.Tensor:
        if features is None:
            raise ValueError(f"{self.method} passes need hidden-state features")
        names = {name: DRAFT_GROUP_PREFIX + name for name in self.head.kv_layer_names}
        ctx = draft_context(runner, self._groups, metas, names)
        return self.head.step(input_ids, positions, features.to(self.dtype), ctx)

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor:
        return self.head.draft_tokens(output)

    def target_states(self, runner: ModelRunner) -> torch.Tensor:
        """The target features of the latest step ``[T, H * n]`` the head's first step reads."""
        if not self.aux_layers:
            return runner.last_hidden_states
        aux = runner.last_aux_hidden_states
        if not aux:
            raise RuntimeError(
                f"{self.method} needs the target's auxiliary hidden states of layers {self.aux_layers}: "
                "build the ModelRunner with this drafter (drafter=...) so it returns them"
            )
        return torch.cat(list(aux), dim=-1)

    def _run(
        self, runner: ModelRunner, dp: DraftPass, input_ids: torch.Tensor, hidden: torch.Tensor, phase: str
    ) -> torch.Tensor:
        kind = DRAFT_PREFILL if phase == DRAFT_PREFILL else DRAFT_DECODE
        return run_pass(runner, self, dp, phase=kind, log_phase=phase, input_ids=input_ids, features=hidden)

    def propose(
        self, runner: ModelRunner, sched_out: SchedulerOutput, sampled: Sequence[Sequence[int]]
    ) -> dict[str, list[int]]:
        view = StepView.from_runner(runner, sampled)
        if not view.req_ids:
            return {}
        device = runner.device
        budget = num_drafts_allowed(view, self.num_speculative_tokens, runner.max_model_len)
        prefill = DraftPass.spans(view.req_ids, view.rows, view.start, view.num_valid)
        # Token one to the right of each position: the next prompt token or the sampled token.
        tokens = runner.batch.token_ids[np.repeat(prefill.rows, prefill.query_lens), prefill.positions + 1]
        features = self.target_states(runner)[torch.from_numpy(view.valid_state_index()).to(device)]
        out = self._run(runner, prefill, torch.from_numpy(tokens).to(device), features, DRAFT_PREFILL)

        active = np.flatnonzero(budget > 0)
        if active.size == 0:
            return {}
        last = torch.from_numpy(prefill.last_token_index()[active]).to(device)
        hidden = out[last]
        draft = self.head.draft_tokens(hidden)
        drafts = [draft]
        for i in range(1, self.num_speculative_tokens):
            keep = budget[active] > i
            if not keep.any():
                break
            mask = torch.from_numpy(keep).to(device)
            active, hidden, draft = active[keep], hidden[mask], draft[mask]
            dp = DraftPass.spans(
                [view.req_ids[j] for j in active],
                view.rows[active],
                view.next_position[active] + i - 1,
                np.ones(active.size, dtype=np.int64),
            )
            hidden = self._run(runner, dp, draft, hidden, f"draft_step_{i}")
            draft = self.head.draft_tokens(hidden)
            drafts.append(draft)
        return collect_drafts(view.req_ids, budget, drafts)


class EagleDrafter(HiddenStateDrafter):
    method = "eagle"


class Eagle3Drafter(HiddenStateDrafter):
    method = "eagle3"


class MTPDrafter(HiddenStateDrafter):
    method = "mtp"


HIDDEN_DRAFTERS: dict[str, type[HiddenStateDrafter]] = {
    "eagle": EagleDrafter,
    "eagle3": Eagle3Drafter,
    "mtp": MTPDrafter,
}


def head_kwargs(method: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Constructor options a checkpoint implies (EAGLE's fc bias, EAGLE-3's draft vocabulary)."""
    if method == "eagle":
        return {"fc_bias": "fc.bias" in state}
    if method == "eagle3" and "lm_head.weight" in state:
        return {"draft_vocab_size": int(state["lm_head.weight"].shape[0])}
    return {}
