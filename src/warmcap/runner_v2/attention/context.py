"""The runner's :class:`~warmcap.contracts.forward_context.ForwardContext`: plain lookups over one
pass's metadata, the KV tensors and the backend registry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from warmcap.contracts.backends import AttentionBackend

if TYPE_CHECKING:
    import torch

    from warmcap.contracts.metadata import AttentionMetadata
    from warmcap.contracts.registry import BackendRegistry

B = TypeVar("B")


@dataclass(slots=True)
class StepContext:
    """One forward pass's context; ``group_kinds`` (group -> ``KVSpec.kind``) picks each layer's
    backend from ``backends``."""

    attn_metadata: Mapping[str, AttentionMetadata]
    layer_to_group: Mapping[str, str]
    kv_caches: Mapping[str, torch.Tensor]
    backends: BackendRegistry
    group_kinds: Mapping[str, str]
    aux_hidden_state_layers: tuple[int, ...] = ()
    aux_hidden_states: list[torch.Tensor] = field(default_factory=list)

    def metadata(self, layer_name: str) -> AttentionMetadata:
        return self.attn_metadata[self.layer_to_group[layer_name]]

    def backend(self, layer_name: str, interface: type[B]) -> B:
        return self.backends.get(self.group_kinds[self.layer_to_group[layer_name]], interface)

    def attention(
        self,
        layer_name: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return self.backend(layer_name, AttentionBackend).forward(
            q,
            k,
            v,
            self.kv_caches[layer_name],
            self.metadata(layer_name),
            scale=scale,
            sliding_window=sliding_window,
        )
