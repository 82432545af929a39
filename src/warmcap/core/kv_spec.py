"""KV cache specs (one per kind of layer state) and KV cache groups.

A spec says how many bytes one block of a layer's state takes and which reservation rule applies;
a group is a set of layers sharing a spec and one block table per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import ClassVar

MAMBA_CACHE_MODES = ("none", "all", "align")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Base spec: tokens per block and bytes per element."""

    block_size: int
    dtype_bytes: int = 4
    kind: ClassVar[str] = "base"

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer takes."""
        raise NotImplementedError(f"{type(self).__name__} must define page_size_bytes")


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVSpec):
    """Causal self-attention: a K and a V vector per token and KV head."""

    num_kv_heads: int = 1
    head_size: int = 64
    kind: ClassVar[str] = "full"

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Self-attention over the last ``sliding_window`` tokens; older blocks may be released."""

    sliding_window: int = 4096
    kind: ClassVar[str] = "sliding_window"


@dataclass(frozen=True, slots=True)
class MLASpec(KVSpec):
    """Multi-head latent attention: one compressed vector (kv_lora_rank + rope dims) per token."""

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    kind: ClassVar[str] = "mla"

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_size * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class IndexerSpec(KVSpec):
    """Sparse-MLA lightning-indexer cache: one key vector per token."""

    head_size: int = 128
    kind: ClassVar[str] = "indexer"

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_size * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class MambaSpec(KVSpec):
    """Mamba conv + SSM state: one whole state per block, ``num_speculative_blocks`` extra slots."""

    state_shapes: tuple[tuple[int, ...], ...] = ()
    cache_mode: str = "none"
    num_speculative_blocks: int = 0
    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        if self.cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba cache_mode must be one of {MAMBA_CACHE_MODES}; got {self.cache_mode!r}")

    @property
    def page_size_bytes(self) -> int:
        return sum(prod(shape) for shape in self.state_shapes) * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class CrossAttentionSpec(KVSpec):
    """Encoder-decoder cross-attention: sized by the encoder length, written once."""

    num_kv_heads: int = 1
    head_size: int = 64
    kind: ClassVar[str] = "cross_attention"

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one spec and one block table per request."""

    name: str
    spec: KVSpec
    layer_names: tuple[str, ...] = ()
    is_drafter: bool = False

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block id across every layer of the group."""
        return self.spec.page_size_bytes * max(1, len(self.layer_names))


def group_layers(
    layer_specs: dict[str, KVSpec], *, prefix: str = "", is_drafter: bool = False
) -> list[KVCacheGroup]:
    """Group layers with equal specs; a group is named after its kind (``full``, ``mla``, ...),
    with a ``.N`` suffix when one kind has several different specs, and ``prefix`` for drafters."""
    by_spec: dict[KVSpec, list[str]] = {}
    for layer, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(layer)
    kinds = [spec.kind for spec in by_spec]
    groups: list[KVCacheGroup] = []
    seen: dict[str, int] = {}
    for spec, layers in by_spec.items():
        name = spec.kind
        if kinds.count(spec.kind) > 1:
            name = f"{spec.kind}.{seen.get(spec.kind, 0)}"
            seen[spec.kind] = seen.get(spec.kind, 0) + 1
        groups.append(KVCacheGroup(f"{prefix}{name}", spec, tuple(layers), is_drafter))
    return groups
