"""KV cache tensors: one per layer, laid out by the layer's spec kind.

Allocation dispatches through :data:`KV_LAYOUTS` (kind -> layout): attention ``[2, nb + 1, bs, H, D]``,
MLA latent and indexer keys ``[nb + 1, bs, D]``, Mamba state ``[nb + 1, conv + ssm elements]``. Every
layout ends in the PAD sink block and is scrubbed by :meth:`KVCaches.zero_blocks` along its block dim.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from warmcap.core.kv_spec import FullAttentionSpec, IndexerSpec, KVCacheGroup, KVSpec, MambaSpec, MLASpec
from warmcap.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one spec kind is stored: ``shape(spec, num_blocks)`` includes the trailing sink block,
    ``block_dim`` is the dimension indexed by block id."""

    shape: Callable[[KVSpec, int], tuple[int, ...]]
    block_dim: int


def _attention_shape(spec: KVSpec, num_blocks: int) -> tuple[int, ...]:
    assert isinstance(spec, FullAttentionSpec)
    # num_blocks + 1: the last block is the sink that PAD slots write to (see contracts/metadata.py).
    return (2, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_size)


def _latent_shape(spec: KVSpec, num_blocks: int) -> tuple[int, ...]:
    # MLA (normed c_kv + rotated k_pe) and the sparse-MLA indexer: one vector per token.
    assert isinstance(spec, (MLASpec, IndexerSpec))
    return (num_blocks + 1, spec.block_size, spec.head_size)


def _mamba_shape(spec: KVSpec, num_blocks: int) -> tuple[int, ...]:
    # One whole state (conv window + SSM state, flattened) per block id; runner_v2.mamba_state
    # splits a row into its views.
    assert isinstance(spec, MambaSpec)
    return (num_blocks + 1, spec.page_size_bytes // spec.dtype_bytes)


KV_LAYOUTS: dict[str, KVLayout] = {
    "full": KVLayout(_attention_shape, block_dim=1),
    "sliding_window": KVLayout(_attention_shape, block_dim=1),
    "mla": KVLayout(_latent_shape, block_dim=0),
    "indexer": KVLayout(_latent_shape, block_dim=0),
    "mamba": KVLayout(_mamba_shape, block_dim=0),
}


def register_kv_layout(kind: str, layout: KVLayout) -> None:
    """Teach the allocator a new spec kind."""
    KV_LAYOUTS[kind] = layout


def _layout(spec: KVSpec) -> KVLayout:
    layout = KV_LAYOUTS.get(spec.kind)
    if layout is None:
        raise ModelLoadError(
            f"no KV layout registered for spec kind {spec.kind!r}; known: {sorted(KV_LAYOUTS)}"
        )
    return layout


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on CPU one whose pages are not touched until written.

    NOTE: ``torch.zeros`` writes every byte, so a CPU pool sized for its worst case is resident from
    start-up (13 GB for a 135M model). A private anonymous mapping reads as zeros and the kernel
    backs a page only once it is written, so resident KV grows with the blocks requests use; a
    block warmup wrote is scrubbed back to zeros (``warmup/run.py``) and stays resident.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping (an exported buffer) for as long as it lives.
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


class KVCaches:
    """The KV tensors of every layer of ``groups``, ``num_blocks`` block ids each (null block 0
    included) plus the sink."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.groups = list(groups)
        self.num_blocks = num_blocks
        self.tensors: dict[str, torch.Tensor] = {}
        self.layer_to_group: dict[str, str] = {}
        # Group -> spec kind: which registered backend serves the group's layers.
        self.group_kinds: dict[str, str] = {g.name: g.spec.kind for g in self.groups}
        self._block_dims: dict[str, int] = {}
        for group in self.groups:
            layout = _layout(group.spec)
            for layer in group.layer_names:
                self.tensors[layer] = zeroed(layout.shape(group.spec, num_blocks), dtype, device)
                self.layer_to_group[layer] = group.name
                self._block_dims[layer] = layout.block_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every group (what the pool sizing divides by)."""
        return sum(g.page_size_bytes for g in self.groups)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def zero_blocks(self, block_ids: Iterable[int], *, groups: Iterable[str] | None = None) -> None:
        """Scrub ``block_ids`` in every layer (or only the layers of ``groups``)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if ids.numel() == 0:
            return
        wanted = None if groups is None else set(groups)
        # One host-to-device copy of the ids per device, not one per layer (each a stream sync on CUDA).
        on_device: dict[torch.device, torch.Tensor] = {}
        for layer, tensor in self.tensors.items():
            if wanted is None or self.layer_to_group[layer] in wanted:
                if tensor.device not in on_device:
                    on_device[tensor.device] = ids.to(tensor.device)
                tensor.index_fill_(self._block_dims[layer], on_device[tensor.device], 0)
