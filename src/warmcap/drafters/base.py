"""The drafter base class: which KV groups a drafter writes, how far ahead, and what it proposes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from warmcap.core.kv_spec import group_layers
from warmcap.errors import ConfigError
from warmcap.runner_v2.collaborators import DRAFT_DECODE, DRAFT_PREFILL, DraftGraphShape
from warmcap.spec_methods import spec_method

if TYPE_CHECKING:
    import torch

    from warmcap.config import EngineConfig
    from warmcap.contracts import AttentionMetadata
    from warmcap.core.kv_spec import KVCacheGroup, KVSpec
    from warmcap.runner_v2.draft_context import DraftContext, DraftKV

DRAFT_GROUP_PREFIX = "draft."

__all__ = [
    "DRAFT_DECODE",
    "DRAFT_GROUP_PREFIX",
    "DRAFT_PREFILL",
    "BaseDrafter",
    "DraftGraphShape",
    "autoregressive_graph_shapes",
]


def autoregressive_graph_shapes(num_speculative_tokens: int) -> list[DraftGraphShape]:
    """A ragged draft prefill, then k - 1 single-token draft decodes per engine step."""
    shapes = [DraftGraphShape(DRAFT_PREFILL, None)]
    if num_speculative_tokens > 1:
        shapes.append(DraftGraphShape(DRAFT_DECODE, 1, repeats=num_speculative_tokens - 1))
    return shapes


class BaseDrafter(ABC):
    """A speculative-decoding proposer: the base every drafter derives from. It satisfies the
    runner's :class:`warmcap.runner_v2.collaborators.Drafter` protocol, the one drafter type the
    runner and graph capture know.

    Subclasses set ``method``; its entry in ``spec_methods.METHODS`` says how many KV slots past a
    request's scheduled tokens the drafter writes (``lookahead``). That number must equal the
    lookahead the KV cache manager reserves (``EngineConfig.num_lookahead_tokens``), otherwise
    drafter writes leave the request's blocks.
    """

    method: ClassVar[str]
    #: target layers whose input hidden states the drafter reads (``ForwardContext`` aux layers)
    aux_layers: tuple[int, ...] = ()

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative
        if spec is None or spec.method != self.method:
            raise ConfigError(f"{type(self).__name__} needs speculative method {self.method!r}; got {spec}")
        self.config = config
        # NOTE: 0 on a P/D producer: its passes write the prompt's KV and nothing drafts, so
        # nothing is written past the scheduled tokens either.
        self.num_speculative_tokens = config.num_speculative_tokens
        k = self.num_speculative_tokens
        self.lookahead = spec_method(self.method).lookahead(k) if k else 0
        #: the drafter's own KV groups, set by ``kv_groups`` (empty for drafters without KV)
        self._groups: list[KVCacheGroup] = []
        if self.lookahead != config.num_lookahead_tokens:
            raise ConfigError(
                f"{self.method} writes {self.lookahead} KV slots past the scheduled tokens but the engine "
                f"reserves {config.num_lookahead_tokens}: the reservation table and the drafter disagree"
            )

    def kv_groups(self, block_size: int) -> list[KVCacheGroup]:
        """The drafter's own KV groups (``is_drafter=True``, names prefixed ``draft.``)."""
        return []

    def _own_groups(self, layer_specs: dict[str, KVSpec]) -> list[KVCacheGroup]:
        """Group the drafter's layers under ``draft.``-prefixed names and remember the groups."""
        prefixed = {DRAFT_GROUP_PREFIX + name: spec for name, spec in layer_specs.items()}
        self._groups = group_layers(prefixed, prefix=DRAFT_GROUP_PREFIX, is_drafter=True)
        return list(self._groups)

    @abstractmethod
    def propose(self, ctx: DraftContext) -> dict[str, list[int]]:
        """Draft tokens for the next step, per request that sampled this step.

        ``ctx`` is all the drafter reads: the step's view (what each request gained: accepted
        drafts plus the sampled token, none for a prompt chunk), the target's states, the
        persistent batch's tokens (this step's already appended) and ``run_pass`` for its passes.
        Drafts are greedy, so the runner verifies them as one-hot proposals.
        """

    def graph_shapes(self) -> list[DraftGraphShape]:
        """The forwards to capture as drafter graphs (none for drafters without a model)."""
        return []

    # ---- the graph seam: drafters with ``graph_shapes`` implement these -------------------------

    def graph_groups(self) -> list[KVCacheGroup]:
        """The drafter KV groups its passes attend over and write (their metadata is static in a
        graph)."""
        return list(self._groups)

    def feature_spec(self, phase: str) -> tuple[int, torch.dtype] | None:
        """Width and dtype of the hidden-state input of ``phase`` passes; None when they read token
        ids and positions only."""
        return None

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
        capture records exactly this call over static buffers."""
        raise NotImplementedError(f"{type(self).__name__} has no model pass (graph_shapes() is empty)")

    def state_metadata(
        self, kv: DraftKV, metas: dict[str, AttentionMetadata], *, static: bool = False
    ) -> dict[str, AttentionMetadata]:
        """``metas`` with whatever per-pass state columns the drafter's own groups need (a draft
        LM's Mamba groups); ``static``: they belong to a graph and are refilled in place. Drafters
        without such groups return ``metas`` as they are."""
        return metas

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor | None:
        """The draft token each output row of a ``phase`` pass would propose (None when the pass
        only writes context), for graph verification."""
        return None
