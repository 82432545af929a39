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
    #: group -> (its attention backend, its metadata), resolved by the group's first layer: every
    #: layer calls :meth:`attention`, and the registry's interface check need not run per layer.
    _attention_groups: dict[str, tuple[AttentionBackend, AttentionMetadata]] = field(
        default_factory=dict, init=False, repr=False
    )

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
        kv_written: bool = False,
    ) -> torch.Tensor:
        group = self.layer_to_group[layer_name]
        resolved = self._attention_groups.get(group)
        if resolved is None:
            backend = self.backends.get(self.group_kinds[group], AttentionBackend)
            resolved = self._attention_groups[group] = (backend, self.attn_metadata[group])
        backend, meta = resolved
        cache = self.kv_caches[layer_name]
        if kv_written and backend.accepts_written_kv:
            return backend.forward(
                q, k, v, cache, meta, scale=scale, sliding_window=sliding_window, kv_written=True
            )
        # A backend that cannot skip its write writes the same k/v at the same slots again.
        return backend.forward(q, k, v, cache, meta, scale=scale, sliding_window=sliding_window)
