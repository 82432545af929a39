"""What a model may read and write during one forward, as a protocol the runner implements.

Model layers never see block tables or the runner: a layer names itself and the context gives its
KV group's metadata, its own cache tensor and the backend registered for its KV kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from warmcap.contracts.metadata import AttentionMetadata

B = TypeVar("B")


class ForwardContext(Protocol):
    """Everything a model's forward needs besides token ids and positions.

    ``aux_hidden_states`` is the one thing a model writes: for each index in
    ``aux_hidden_state_layers`` (EAGLE-3 style drafters read them), in the listed order, the
    residual stream entering that layer.
    """

    @property
    def attn_metadata(self) -> Mapping[str, AttentionMetadata]:
        """KV group name -> the group's metadata for this pass."""

    @property
    def layer_to_group(self) -> Mapping[str, str]:
        """Layer name -> its KV group."""

    @property
    def kv_caches(self) -> Mapping[str, torch.Tensor]:
        """Layer name -> the layer's cache tensor."""

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """Layers whose input hidden states the caller wants."""

    @property
    def aux_hidden_states(self) -> list[torch.Tensor]:
        """Filled by the model, in the order of ``aux_hidden_state_layers``."""

    def metadata(self, layer_name: str) -> AttentionMetadata:
        """The metadata of ``layer_name``'s KV group."""
        ...

    def backend(self, layer_name: str, interface: type[B]) -> B:
        """The backend registered for ``layer_name``'s KV kind, checked to implement ``interface``."""
        ...

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
        """Paged attention for one full / sliding-window layer with its group's metadata and cache.

        ``kv_written``: the caller already wrote ``k``/``v`` at the metadata's ``slot_mapping``
        (PAD to the sink) of ``kv_caches[layer_name]`` (``models/fused_ops.py``); a backend that
        honours it (:attr:`~warmcap.contracts.backends.AttentionBackend.accepts_written_kv`) skips
        its own write, any other writes the same values again."""
        ...
