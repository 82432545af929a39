"""The drafter base classes: which KV groups a drafter writes, how far ahead, and what it proposes.

A drafter is a proposal strategy (:class:`BaseDrafter`, the runner's
:class:`~warmcap.runner_v2.collaborators.Drafter`) and, unless it drafts without a model, the
model its passes run (:class:`PagedDraftModel`, a
:class:`~warmcap.runner_v2.collaborators.DraftModel`). The interfaces are declared once, in
``runner_v2/collaborators.py``; these classes implement them. The strategy runs its passes through
the executor it is bound to and never sees the runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch import nn

from warmcap.core.kv_spec import group_layers
from warmcap.errors import ConfigError
from warmcap.runner_v2.collaborators import DRAFT_DECODE, DRAFT_PREFILL, Drafter, DraftGraphShape, DraftModel
from warmcap.spec_methods import spec_method

if TYPE_CHECKING:
    from warmcap.config import EngineConfig
    from warmcap.core.kv_spec import KVCacheGroup, KVSpec
    from warmcap.runner_v2.draft_context import DraftPasses

DRAFT_GROUP_PREFIX = "draft."

__all__ = [
    "DRAFT_DECODE",
    "DRAFT_GROUP_PREFIX",
    "DRAFT_PREFILL",
    "BaseDrafter",
    "DraftGraphShape",
    "PagedDraftModel",
    "autoregressive_graph_shapes",
]


def autoregressive_graph_shapes(num_speculative_tokens: int) -> list[DraftGraphShape]:
    """A ragged draft prefill, then k - 1 single-token draft decodes per engine step."""
    shapes = [DraftGraphShape(DRAFT_PREFILL, None)]
    if num_speculative_tokens > 1:
        shapes.append(DraftGraphShape(DRAFT_DECODE, 1, repeats=num_speculative_tokens - 1))
    return shapes


class PagedDraftModel(DraftModel):
    """A draft model over its own ``draft.``-prefixed paged KV groups. Subclasses give its layers'
    KV specs (:meth:`layer_specs`) and its pass (``forward_pass``); the strategy that builds it
    gives the passes it runs per step (``shapes``)."""

    def __init__(self, shapes: list[DraftGraphShape]) -> None:
        self._shapes = list(shapes)
        #: the model's KV groups, set by ``kv_groups``
        self._groups: list[KVCacheGroup] = []

    def layer_specs(self, block_size: int) -> dict[str, KVSpec]:
        """KV spec per layer name of the module it runs (unprefixed)."""
        raise NotImplementedError

    def graph_shapes(self) -> list[DraftGraphShape]:
        return list(self._shapes)

    def kv_groups(self, block_size: int) -> list[KVCacheGroup]:
        prefixed = {DRAFT_GROUP_PREFIX + name: spec for name, spec in self.layer_specs(block_size).items()}
        self._groups = group_layers(prefixed, prefix=DRAFT_GROUP_PREFIX, is_drafter=True)
        return list(self._groups)

    def graph_groups(self) -> list[KVCacheGroup]:
        return list(self._groups)

    def modules(self) -> list[nn.Module]:
        # Its modules are its module attributes (a head, a draft LM).
        return [v for v in vars(self).values() if isinstance(v, nn.Module)]


class BaseDrafter(Drafter):
    """A speculative-decoding proposal strategy: the base every drafter derives from.

    Subclasses set ``method``; its entry in ``spec_methods.METHODS`` says how many KV slots past a
    request's scheduled tokens the drafter writes (``lookahead``). That number must equal the
    lookahead the KV cache manager reserves (``EngineConfig.num_lookahead_tokens``), otherwise
    drafter writes leave the request's blocks. A drafter with a model sets ``draft_model`` in its
    constructor; the runner binds it to its executor (:meth:`bind`) before the first step.
    """

    method: ClassVar[str]
    aux_layers: tuple[int, ...] = ()
    draft_model: DraftModel | None = None

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
        self._executor: DraftPasses | None = None
        if self.lookahead != config.num_lookahead_tokens:
            raise ConfigError(
                f"{self.method} writes {self.lookahead} KV slots past the scheduled tokens but the engine "
                f"reserves {config.num_lookahead_tokens}: the reservation table and the drafter disagree"
            )

    def kv_groups(self, block_size: int) -> list[KVCacheGroup]:
        """The drafter's own KV groups (``is_drafter=True``, names prefixed ``draft.``): its model's."""
        return self.draft_model.kv_groups(block_size) if self.draft_model is not None else []

    def graph_groups(self) -> list[KVCacheGroup]:
        """The KV groups its passes write (its model's; none without a model)."""
        return self.draft_model.graph_groups() if self.draft_model is not None else []

    def bind(self, executor: DraftPasses) -> None:
        self._executor = executor

    @property
    def executor(self) -> DraftPasses:
        """The executor of this drafter's passes (set by the runner with :meth:`bind`)."""
        if self._executor is None:
            raise RuntimeError(
                f"{type(self).__name__} has no draft executor: build the runner with this drafter "
                "(it binds its executor to the drafter)"
            )
        return self._executor
