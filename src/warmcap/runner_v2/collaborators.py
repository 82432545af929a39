"""What the runner needs from its collaborators: the drafter and the graph dispatcher.

Both are handed to :class:`~warmcap.runner_v2.model_runner.ModelRunner` (the drafter as a
constructor argument, the dispatcher once through ``attach_graphs``); nothing outside
``runner_v2`` assigns runner attributes. The protocols live here, next to the runner, so the
runner imports neither ``warmcap.drafters`` nor ``warmcap.graphs``: drafters
(:class:`warmcap.drafters.base.BaseDrafter`) and graphs (``warmcap.graphs.capture.graph_runner``)
implement them.

Also here: the vocabulary both sides share, the drafter pass phases and :class:`DraftPass`, one
drafter forward over ragged per-request position spans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from warmcap.runner_v2.draft_context import DraftPass

if TYPE_CHECKING:
    import torch

    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup
    from warmcap.runner_v2.draft_context import DraftContext, DraftKV
    from warmcap.runner_v2.input_batch import StepInputs

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


class Drafter(Protocol):
    """A speculative-decoding proposer, as the runner and graph capture use it: a callee that is
    handed what it reads (``runner_v2/draft_context.py``) and never holds or types the runner.

    ``propose`` runs after each target step; drafters with a model also describe their passes
    (``graph_shapes``, ``graph_groups``, ``feature_spec``) and run one over given inputs
    (``forward_pass``), which the runner calls through its drafter buffers and graph capture records.
    """

    #: target layers whose input hidden states the drafter reads (``ForwardContext`` aux layers)
    aux_layers: tuple[int, ...]

    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        """Draft tokens for the next step, per request that sampled this step."""
        ...

    def graph_shapes(self) -> list[DraftGraphShape]:
        """The forwards to capture as drafter graphs (none for drafters without a model)."""
        ...

    def graph_groups(self) -> list[KVCacheGroup]:
        """The drafter KV groups its passes attend over and write."""
        ...

    def feature_spec(self, phase: str) -> tuple[int, torch.dtype] | None:
        """Width and dtype of the hidden-state input of ``phase`` passes (None: ids only)."""
        ...

    def forward_pass(
        self,
        kv: DraftKV,
        phase: str,
        metas: dict[str, AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None,
    ) -> torch.Tensor:
        """One ``phase`` pass over the given inputs and metadata, eagerly; returns ``[T, H]``."""
        ...

    def state_metadata(
        self, kv: DraftKV, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with the per-pass state columns of the drafter's own groups."""
        ...

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor | None:
        """The draft token each output row of a ``phase`` pass would propose (None: none)."""
        ...


@dataclass(frozen=True, slots=True)
class GraphReplay:
    """What a replayed graph produced: its output rows of the real tokens, auxiliary outputs, and
    the (padded) metadata it ran over, which the runner's KV-write log records."""

    output: torch.Tensor
    aux: list[torch.Tensor]
    metas: dict[str, AttentionMetadata]


class GraphDispatcher(Protocol):
    """Captured graphs, as the runner uses them: each call loads the pass padded into its static
    buffers and replays the graph that fits, or returns None (the runner then runs it eagerly)."""

    def replay_step(self, step: StepInputs) -> GraphReplay | None:
        """A target step from a graph, or None."""
        ...

    def replay_draft(
        self, phase: str, dp: DraftPass, input_ids: torch.Tensor, features: torch.Tensor | None
    ) -> GraphReplay | None:
        """A drafter pass of ``phase`` from a graph, or None."""
        ...
