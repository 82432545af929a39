"""The backend interfaces model layers call, one per kind of KV state.

A model layer computes its projections (and RoPE) and hands the kernel part to the backend of its
layer's KV kind, found through :meth:`ForwardContext.backend`; it never constructs one. The runner
registers the implementations (:mod:`warmcap.runner_v2.attention.selector`).

Every ``forward``/``select`` writes this step's vectors into the layer's cache through
``meta.slot_mapping`` first (PAD slots go to the sink block), then reads the context; an attention
backend with ``accepts_written_kv`` skips the write when the layer says it wrote them there itself
(``kv_written``, the fused RoPE + KV write of ``models/fused_ops.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from warmcap.contracts.metadata import AttentionMetadata, MambaMetadata

#: Largest per-row query length a :class:`MambaBackend` must serve graph-safely (uniform batches:
#: decode, spec verify); longer or ragged rows may take a scan that reads host lists. Graph planning
#: (:mod:`warmcap.graphs.capture.planning`) leaves such batches out of CUDA graphs.
MAX_UNIFORM_QUERY_LEN = 16


class AttentionBackend(ABC):
    """Paged attention over K/V caches (full and sliding-window layers)."""

    name: str = "base"
    #: whether a whole forward using this backend can be captured as one FULL graph
    supports_full_graph: bool = False
    #: whether :meth:`forward` takes ``kv_written=True`` (k/v already at ``meta.slot_mapping``,
    #: nothing to write); a backend without it is called without the keyword and writes them again
    accepts_written_kv: bool = False

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
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> output [T, Hq, D]; writes k/v into ``kv_cache`` first,
        unless ``kv_written`` (passed only to a backend with :attr:`accepts_written_kv`)."""

    def prepare_for_capture(self, metas: dict[str, AttentionMetadata]) -> None:  # noqa: B027
        """Hook before recording a graph over these (static) metadata buffers."""

    def prepare_for_replay(self, metas: dict[str, AttentionMetadata]) -> None:  # noqa: B027
        """Hook before replaying a graph after the static buffers were refilled."""


@dataclass(frozen=True, slots=True)
class MLAWeights:
    """The per-head halves of ``kv_b_proj``: ``w_uk`` [H, Dn, R] and ``w_uv`` [H, Dv, R]."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    def from_kv_b_proj(cls, weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int) -> MLAWeights:
        """Split ``kv_b_proj.weight`` [H * (Dn + Dv), R] into ``W_UK`` and ``W_UV``."""
        per_head = weight.view(num_heads, -1, weight.shape[-1])
        return cls(per_head[:, :qk_nope_head_dim], per_head[:, qk_nope_head_dim:])


class MLABackend(ABC):
    """Paged multi-head latent attention over the latent cache (DeepSeek MLA layers)."""

    name: str = "base"

    @abstractmethod
    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        weights: MLAWeights,
        *,
        scale: float,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, Dr] (rotated), latent [T, R + Dr] (normed c_kv, rotated
        k_pe) -> [T, H, Dv]. Writes ``latent`` into ``kv_cache`` first.

        ``allowed`` [T, max_seq_len] bool restricts each query to selected context positions
        (sparse MLA); causality and sequence bounds are always applied on top.
        """


class IndexerBackend(ABC):
    """Top-k context selection of a sparse-MLA lightning indexer over its key cache."""

    name: str = "base"

    @abstractmethod
    def select(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        top_k: int,
    ) -> torch.Tensor:
        """q [T, H, D] (rotated), k [T, D] (this step's keys), weights [T, H] -> [T, max_seq_len]
        bool: the ``top_k`` best visible context positions of each query, scored
        ``sum_h weights[h] * relu(q_h . key_s * scale)``. Writes ``k`` into ``kv_cache`` first."""


@dataclass(frozen=True, slots=True)
class MambaWeights:
    """What a Mamba2 mixer hands its backend besides the step's inputs.

    ``conv_weight`` [C, 1, d_conv] and ``conv_bias`` [C] (or None) of the depthwise causal conv,
    ``a`` [H] = ``-exp(A_log)`` (float32), ``d`` [H] the skip, ``activation`` applied after the conv;
    ``C = num_heads * head_dim + 2 * n_groups * d_state`` (x, then B, then C).
    """

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    a: torch.Tensor
    d: torch.Tensor
    activation: Callable[[torch.Tensor], torch.Tensor]
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    chunk_size: int

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv window, SSM state) shapes of one request's state."""
        conv_dim = self.conv_weight.shape[0]
        return (conv_dim, self.conv_weight.shape[-1] - 1), (self.num_heads, self.head_dim, self.d_state)


class MambaBackend(ABC):
    """The conv + SSD recurrence of Mamba2 layers over paged per-request states.

    Per row of the step the backend reads the conv window and SSM state at ``meta.read_blocks``
    (-1: start from zero), runs the row's tokens through the causal conv and the recurrence, and
    stores the states reached after each token whose ``meta.write_blocks`` entry is a block (the
    runner's Mamba state handler plans both). Every row reads before any row's state is stored.
    Batches whose rows all have the same ``q <= MAX_UNIFORM_QUERY_LEN`` tokens must run without a
    host read of device data (they are captured in CUDA graphs).
    """

    name: str = "base"

    @abstractmethod
    def forward(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        state: torch.Tensor,
        meta: MambaMetadata,
        weights: MambaWeights,
    ) -> torch.Tensor:
        """xbc [T, C] (before the conv), dt [T, H] (after softplus and clamping, float32), ``state``
        the layer's ``[num_blocks + 1, total]`` state tensor (last row: a sink nothing reads)
        -> y [T, H, P] float32, the skip ``d * x`` included; stores states into ``state``."""
