"""What the runner needs from its collaborators: the drafter and the graph dispatcher.

Both are handed to :class:`~warmcap.runner_v2.model_runner.ModelRunner` (the drafter as a
constructor argument, the dispatcher once through ``attach_graphs``); nothing outside
``runner_v2`` assigns runner attributes. The protocols live here, next to the runner, so the
runner imports neither ``warmcap.drafters`` nor ``warmcap.graphs``; this is the one place the
drafter's interface is declared: drafters (``warmcap.drafters``) subclass :class:`Drafter` and
:class:`DraftModel` and only implement them.

A drafter is two objects:

- the :class:`Drafter` (the proposal strategy: n-gram lookup, the autoregressive loop, DFlash's
  block), called once per step with a :class:`~warmcap.runner_v2.draft_context.DraftContext`, and
- its :class:`DraftModel` (None for n-gram): the weights and the one forward a pass runs. The
  runner's :class:`~warmcap.runner_v2.draft_executor.DraftExecutor` runs it (drafter buffers,
  drafter graphs, the KV-write log) and is handed to the strategy once, with :meth:`Drafter.bind`.

So a step goes runner -> strategy -> executor -> draft model and never back up the stack.

Also here: the vocabulary both sides share, the drafter pass phases and :class:`DraftPass`, one
drafter forward over ragged per-request position spans.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from warmcap.runner_v2.draft_context import DraftPass

if TYPE_CHECKING:
    import torch
    from torch import nn

    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.draft_context import DraftContext, DraftKV, DraftPasses, DraftTokens
    from warmcap.runner_v2.input_batch import StepInputs

__all__ = [
    "DRAFT_DECODE",
    "DRAFT_PREFILL",
    "DraftGraphShape",
    "DraftModel",
    "DraftPass",
    "Drafter",
    "GraphDispatcher",
    "GraphReplay",
]

DRAFT_PREFILL = "draft_prefill"
DRAFT_DECODE = "draft_decode"


@dataclass(frozen=True, slots=True)
class DraftGraphShape:
    """One forward a drafter runs per engine step, for the graphs helper to capture.

    ``query_len`` is the tokens per request (uniform across the batch); ``None`` means ragged (a
    draft prefill over each request's new tokens). ``repeats`` is how many times the shape runs per
    engine step (k - 1 autoregressive draft decodes, for instance).
    """

    phase: str  # "draft_prefill" or "draft_decode"
    query_len: int | None
    repeats: int = 1


class DraftModel(Protocol):
    """The model half of a drafter: what one drafter pass runs, what graph capture records and
    verification replays. It reads only what it is handed (a :class:`DraftKV`, metadata, inputs).
    """

    @abstractmethod
    def graph_shapes(self) -> list[DraftGraphShape]:
        """The passes its strategy runs per engine step, to capture as drafter graphs."""

    @abstractmethod
    def kv_groups(self, block_size: int) -> list[KVCacheGroup]:
        """Its own KV groups (``is_drafter=True``, names prefixed ``draft.``), remembered."""

    @abstractmethod
    def graph_groups(self) -> list[KVCacheGroup]:
        """The KV groups its passes attend over and write (static metadata in a graph)."""

    @abstractmethod
    def forward_pass(
        self,
        kv: DraftKV,
        phase: str,
        metas: dict[str, AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None,
    ) -> torch.Tensor:
        """One ``phase`` pass over the given inputs and metadata, eagerly; returns ``[T, H]``. Graph
        capture records exactly this call over the executor's static buffers."""

    @abstractmethod
    def modules(self) -> list[nn.Module]:
        """Every module its passes may run (graph safety fakes their parameters)."""

    def feature_spec(self, phase: str) -> tuple[int, torch.dtype] | None:
        """Width and dtype of the hidden-state input of ``phase`` passes; None: ids and positions
        only."""
        return None

    def state_metadata(
        self, kv: DraftKV, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with the per-pass state columns of its own groups (a draft LM's Mamba groups);
        ``static``: they belong to a graph and are refilled in place. Without such groups: as they
        are."""
        return metas

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor | None:
        """The draft token each output row of a ``phase`` pass proposes (None: the pass only
        writes context)."""
        return None


class Drafter(Protocol):
    """A speculative-decoding proposal strategy, as the runner uses it: called after each target
    step with what it reads (``runner_v2/draft_context.py``); its passes go through the executor it
    was bound to. It never holds, reads or types the runner.
    """

    #: target layers whose input hidden states the drafter reads (``ForwardContext`` aux layers)
    aux_layers: tuple[int, ...]
    #: the model its passes run (None: a drafter without a model, n-gram)
    draft_model: DraftModel | None

    @abstractmethod
    def bind(self, executor: DraftPasses) -> None:
        """Run every later pass through ``executor`` (called once, by the runner that owns it:
        its :class:`~warmcap.runner_v2.draft_executor.DraftExecutor`)."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> DraftTokens:
        """Draft tokens for the next step, on the device, per request that sampled this step."""


@dataclass(frozen=True, slots=True)
class GraphReplay:
    """What a replayed graph produced: its output rows of the real tokens, auxiliary outputs, and
    the (padded) metadata it ran over, which the runner's KV-write log records."""

    output: torch.Tensor
    aux: list[torch.Tensor]
    metas: dict[str, AttentionMetadata]


class GraphDispatcher(Protocol):
    """Captured graphs, as the runner and its draft executor use them: each call loads the pass
    padded into its static buffers and replays the graph that fits, or returns None (the pass then
    runs eagerly)."""

    def replay_step(self, step: StepInputs) -> GraphReplay | None:
        """A target step from a graph, or None."""
        ...

    def replay_draft(
        self, phase: str, dp: DraftPass, input_ids: torch.Tensor, features: torch.Tensor | None
    ) -> GraphReplay | None:
        """A drafter pass of ``phase`` from a graph, or None."""
        ...
