"""Drafters fed by the target's hidden states: the head-drafter base (EAGLE, EAGLE-3, MTP and
DFlash) and the autoregressive EAGLE, EAGLE-3 and MTP drafters.

In the autoregressive ones, position ``p`` of the drafter pairs the target's state at ``p`` with the token at ``p + 1`` and
predicts the token at ``p + 2``. Each engine step:

- ``draft_prefill``: positions ``start .. start + valid - 1`` (the target states of real tokens this
  step; rejected drafts excluded) with the tokens one to the right; its last output drafts token 1.
- ``draft_step_i`` (i = 1 .. k-1): position ``P + i - 1`` (``P``: the sampled token's position)
  with draft ``i`` and the drafter's own previous output in place of a target state.

Writes reach at most position ``P + k - 2 <= start + scheduled + k - 2``: inside the lookahead k.
Positions written with the drafter's own states are rewritten from target states once accepted.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from warmcap.drafters.autoregressive import AutoregressiveDrafter
from warmcap.drafters.base import (
    DRAFT_GROUP_PREFIX,
    DRAFT_PREFILL,
    BaseDrafter,
    PagedDraftModel,
    autoregressive_graph_shapes,
)
from warmcap.drafters.heads import DeepseekMTPHead, DraftHead, Eagle3Head, EagleHead, MTPHead, TargetTiedHead
from warmcap.drafters.paged import DraftContext, DraftPass, forward_context
from warmcap.drafters.registry import register
from warmcap.models.deepseek_v3 import DeepseekV3ForCausalLM

if TYPE_CHECKING:
    from torch import nn

    from warmcap.config import EngineConfig
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVSpec
    from warmcap.drafters.base import DraftGraphShape
    from warmcap.drafters.paged import DraftKV


class HeadModel(PagedDraftModel):
    """A head tied to the target, run over its own ``draft.`` KV groups: the model half of the
    head drafters. Its passes read the target's states (or its own) as features."""

    def __init__(self, head: TargetTiedHead, shapes: list[DraftGraphShape], *, method: str) -> None:
        super().__init__(shapes)
        self.head = head
        self.method = method
        self.dtype = next(head.parameters()).dtype

    def layer_specs(self, block_size: int) -> dict[str, KVSpec]:
        return self.head.kv_layer_specs(block_size, self.dtype)


class HeadDraftModel(HeadModel):
    """A :class:`DraftHead` step: ``draft_prefill`` over target features (EAGLE-3: its aux layers
    side by side), ``draft_decode`` over its own previous output."""

    head: DraftHead

    def __init__(
        self, head: DraftHead, shapes: list[DraftGraphShape], *, method: str, aux_layers: tuple[int, ...]
    ) -> None:
        super().__init__(head, shapes, method=method)
        self.num_aux_layers = len(aux_layers)

    def feature_spec(self, phase: str) -> tuple[int, torch.dtype]:
        width = self.head.cfg.hidden_size
        if phase == DRAFT_PREFILL and self.num_aux_layers:
            width *= self.num_aux_layers
        return width, self.dtype

    def forward_pass(
        self,
        kv: DraftKV,
        phase: str,
        metas: dict[str, AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None,
    ) -> torch.Tensor:
        if features is None:
            raise ValueError(f"{self.method} passes need hidden-state features")
        names = {name: DRAFT_GROUP_PREFIX + name for name in self.head.kv_layer_names}
        ctx = forward_context(kv, self._groups, metas, names)
        return self.head.step(input_ids, positions, features.to(self.dtype), ctx)

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor:
        return self.head.draft_tokens(output)


class HeadDrafter(BaseDrafter):
    """A drafter running a head tied to the target over its own ``draft.`` KV groups, conditioned
    on the target's hidden states (the final ones, or the inputs of ``aux_layers``)."""

    def __init__(
        self, config: EngineConfig, head: TargetTiedHead, *, aux_layers: tuple[int, ...] = ()
    ) -> None:
        super().__init__(config)
        #: the head's weights (the model half runs them)
        self.head = head
        #: target layers whose inputs the head consumes, in concatenation order
        self.aux_layers = aux_layers
        self.dtype = next(head.parameters()).dtype
        self.draft_model = self.make_model()

    @staticmethod
    @abstractmethod
    def make_head(
        cfg: Any, target: nn.Module, state: dict[str, torch.Tensor] | None, aux_layers: tuple[int, ...]
    ) -> TargetTiedHead:
        """The method's head shaped by ``cfg`` (the target's config with the head directory's on
        top) and by what its checkpoint ``state`` implies (None: no head directory)."""

    @abstractmethod
    def make_model(self) -> HeadModel:
        """The model half running ``self.head`` (called once, by the constructor)."""

    def target_states(self, ctx: DraftContext) -> torch.Tensor:
        """The target features of the step ``[T, H * n]``: the final hidden states, or the inputs
        of ``aux_layers`` side by side."""
        if not self.aux_layers:
            return ctx.hidden_states
        aux = ctx.aux_hidden_states
        if not aux:
            raise RuntimeError(
                f"{self.method} needs the target's auxiliary hidden states of layers {self.aux_layers}: "
                "build the runner with this drafter (drafter=...) so its forward collects them"
            )
        return torch.cat(list(aux), dim=-1)


class HiddenStateDrafter(HeadDrafter, AutoregressiveDrafter):
    """Runs a :class:`DraftHead` step by step, each step fed its own previous output."""

    head: DraftHead
    # Draft i pairs with the head's own state of the position before it: P + i - 1.
    step_offset: ClassVar[int] = -1

    def make_model(self) -> HeadDraftModel:
        shapes = autoregressive_graph_shapes(self.num_speculative_tokens)
        return HeadDraftModel(self.head, shapes, method=self.method, aux_layers=self.aux_layers)

    def prefill_inputs(self, ctx: DraftContext) -> tuple[DraftPass, torch.Tensor, torch.Tensor]:
        # The target states of real tokens this step (rejected drafts excluded), each paired with
        # the token one to the right: the next prompt token or the sampled token.
        view = ctx.view
        prefill = DraftPass.spans(view.req_ids, view.rows, view.start, view.num_valid)
        tokens = ctx.token_ids[np.repeat(prefill.rows, prefill.query_lens), prefill.positions + 1]
        device = ctx.device
        features = self.target_states(ctx)[torch.from_numpy(view.valid_state_index()).to(device)]
        return prefill, torch.from_numpy(tokens).to(device), features

    def step_features(self, output: torch.Tensor) -> torch.Tensor:
        return output


@register
class EagleDrafter(HiddenStateDrafter):
    method = "eagle"

    @staticmethod
    def make_head(
        cfg: Any, target: nn.Module, state: dict[str, torch.Tensor] | None, aux_layers: tuple[int, ...]
    ) -> DraftHead:
        # EAGLE checkpoints differ in whether ``fc`` has a bias.
        return EagleHead(cfg, target, fc_bias="fc.bias" in (state or {}))


@register
class Eagle3Drafter(HiddenStateDrafter):
    method = "eagle3"

    @staticmethod
    def make_head(
        cfg: Any, target: nn.Module, state: dict[str, torch.Tensor] | None, aux_layers: tuple[int, ...]
    ) -> DraftHead:
        # A checkpoint's own LM head fixes its draft vocabulary (mapped to target ids by ``d2t``).
        lm_head = (state or {}).get("lm_head.weight")
        return Eagle3Head(cfg, target, draft_vocab_size=None if lm_head is None else int(lm_head.shape[0]))


@register
class MTPDrafter(HiddenStateDrafter):
    method = "mtp"

    @staticmethod
    def make_head(
        cfg: Any, target: nn.Module, state: dict[str, torch.Tensor] | None, aux_layers: tuple[int, ...]
    ) -> DraftHead:
        # On a DeepSeek target the MTP layer is a DeepSeek layer (MLA + MoE) like the target's.
        if isinstance(target, DeepseekV3ForCausalLM):
            return DeepseekMTPHead(cfg, target)
        return MTPHead(cfg, target)
