"""Where each KV block lives in memory, per layer, in a form a peer can read from.

Every layout ``runner_v2/kv_cache.py`` allocates is, per layer, some number of *planes* (the K and
V halves of attention, the one latent of MLA), each a run of equally sized, contiguous blocks. A
block of a layer is then ``plane base + block id * block bytes`` for each plane, which is what a
NIXL descriptor names. Mamba state is not a per-position cache (one whole state per block id, only
the last one meaningful), so it is not moved: a model with it is refused at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from warmcap.errors import ConfigError
from warmcap.kv_transfer.params import KVTransferError
from warmcap.runner_v2.kv_cache import KV_LAYOUTS

if TYPE_CHECKING:
    import torch

    from warmcap.core.kv_spec import KVCacheGroup

#: group kinds whose blocks hold per-position KV, so copying blocks moves a prompt's cache
MOVABLE_KINDS: frozenset[str] = frozenset({"full", "sliding_window", "mla", "indexer"})


@dataclass(frozen=True, slots=True)
class LayerRegion:
    """One layer's KV tensor as planes of contiguous blocks."""

    group: str
    #: address of block 0 in each plane
    plane_bases: tuple[int, ...]
    block_bytes: int
    num_blocks: int
    device_id: int

    def block_descs(self, block_id: int) -> list[tuple[int, int, int]]:
        """(address, bytes, device) of ``block_id`` in each plane."""
        return [
            (base + block_id * self.block_bytes, self.block_bytes, self.device_id)
            for base in self.plane_bases
        ]


def check_movable(groups: list[KVCacheGroup]) -> None:
    """Refuse, at start-up, a group kind whose KV cannot be moved block by block."""
    bad = sorted({g.spec.kind for g in groups if g.spec.kind not in MOVABLE_KINDS})
    if bad:
        raise ConfigError(
            f"the NIXL connector cannot transfer KV groups of kind {bad} (it moves {sorted(MOVABLE_KINDS)}): "
            "serve this model without --kv-transfer-config"
        )


def layer_regions(
    tensors: dict[str, torch.Tensor], layer_groups: dict[str, str], groups: list[KVCacheGroup]
) -> dict[str, LayerRegion]:
    """Each layer's planes, from the tensors ``runner_v2/kv_cache.py`` allocated."""
    kinds = {g.name: g.spec.kind for g in groups}
    regions = {}
    for layer, tensor in tensors.items():
        group = layer_groups[layer]
        block_dim = KV_LAYOUTS[kinds[group]].block_dim
        # NOTE: the planes are views of one contiguous tensor, so their bases are exact offsets.
        assert tensor.is_contiguous(), f"KV tensor of {layer} is not contiguous"
        planes = tensor.reshape(-1, *tensor.shape[block_dim:])
        block_bytes = planes[0][0].numel() * tensor.element_size()
        device = tensor.get_device()
        regions[layer] = LayerRegion(
            group=group,
            plane_bases=tuple(p.data_ptr() for p in planes),
            block_bytes=block_bytes,
            num_blocks=tensor.shape[block_dim],
            device_id=max(device, 0),
        )
    return regions


def regions_to_json(regions: dict[str, LayerRegion]) -> dict[str, Any]:
    return {
        layer: {
            "group": r.group,
            "plane_bases": list(r.plane_bases),
            "block_bytes": r.block_bytes,
            "num_blocks": r.num_blocks,
            "device_id": r.device_id,
        }
        for layer, r in regions.items()
    }


def regions_from_json(data: Any, peer: str) -> dict[str, LayerRegion]:
    try:
        return {
            str(layer): LayerRegion(
                group=str(r["group"]),
                plane_bases=tuple(int(b) for b in r["plane_bases"]),
                block_bytes=int(r["block_bytes"]),
                num_blocks=int(r["num_blocks"]),
                device_id=int(r["device_id"]),
            )
            for layer, r in data.items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise KVTransferError(
            f"the KV layout {peer} sent is malformed ({exc!r}): is it a warmcap server?"
        ) from None


def check_compatible(local: dict[str, LayerRegion], remote: dict[str, LayerRegion], peer: str) -> None:
    """Every local layer that has a peer layer of the same name must have the same block size."""
    for layer, mine in local.items():
        theirs = remote.get(layer)
        if theirs is not None and theirs.block_bytes != mine.block_bytes:
            raise KVTransferError(
                f"layer {layer} has {theirs.block_bytes} bytes per KV block on {peer} but "
                f"{mine.block_bytes} here: run prefill and decode with the same model, dtype and block size"
            )
