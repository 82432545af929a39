"""The attention contract between model code and the runner.

Model layers never see block tables: they call :meth:`ForwardContext.attention` with their layer
name, and the context finds the layer's KV group, that group's metadata and the layer's cache.

KV tensor layout (full / sliding-window attention): ``[2, num_blocks + 1, block_size, num_kv_heads,
head_size]``. The extra last block (index ``num_blocks``) is the *sink*: PAD slots (-1) are redirected
there so writes stay graph-safe (no boolean indexing) and never touch the null block 0. No block
table ever names the sink, so attention never reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PAD_SLOT_ID = -1


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step, per-KV-group inputs of attention. Row i is request i of the flattened batch.

    - ``query_start_loc`` int32 [R+1]: query tokens of row i are ``[qsl[i], qsl[i+1])``;
      ``qsl[R] == num_tokens`` (padded tokens belong to padded rows).
    - ``seq_lens`` int32 [R]: context length after this step (computed + scheduled); the queries of
      row i sit at positions ``seq_len - query_len .. seq_len - 1``. Padded rows have 0 and their
      outputs are zero.
    - ``block_table`` int32 [R, max_blocks]: padded rows are all zero (the null block).
    - ``slot_mapping`` int64 [T]: ``block * block_size + offset`` or PAD (-1) for padded tokens.
    """

    num_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so backends can plan without a device sync.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Computes paged attention and writes the step's K/V through the slot mapping."""

    name: str = "base"
    #: whether a whole forward using this backend can be captured as one FULL graph
    supports_full_graph: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> output [T, Hq, D]; writes k/v into ``kv_cache`` first."""

    def prepare_for_capture(self, metas: dict[str, AttentionMetadata]) -> None:  # noqa: B027
        """Hook before recording a graph over these (static) metadata buffers."""

    def prepare_for_replay(self, metas: dict[str, AttentionMetadata]) -> None:  # noqa: B027
        """Hook before replaying a graph after the static buffers were refilled."""


@dataclass(slots=True)
class ForwardContext:
    """Everything a model's forward needs besides token ids and positions."""

    attn_metadata: dict[str, AttentionMetadata]
    layer_to_group: dict[str, str]
    kv_caches: dict[str, torch.Tensor]
    backend: AttentionBackend
    # Layers whose output hidden states the caller wants (EAGLE-3 style drafters); filled in order.
    aux_hidden_state_layers: tuple[int, ...] = ()
    aux_hidden_states: list[torch.Tensor] = field(default_factory=list)

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
        """Run the backend for one layer with its group's metadata and its own cache."""
        meta = self.attn_metadata[self.layer_to_group[layer_name]]
        return self.backend.forward(
            q, k, v, self.kv_caches[layer_name], meta, scale=scale, sliding_window=sliding_window
        )
