"""Fill every free, uncached KV block with NaN: a debugging check that an engine never reads KV it
did not write or load (a read of such a block turns its outputs into NaN, which the engine's
non-finite check reports). ``warmup serve --poison-free-kv`` applies it once start-up is done."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from warmcap.runner_v2.kv_cache import KV_LAYOUTS

if TYPE_CHECKING:
    from warmcap.engine import LLMEngine


def poison_free_blocks(engine: LLMEngine, value: float = float("nan")) -> int:
    """Write ``value`` over every free block no prefix-cache entry points at; returns how many."""
    pool = engine.kv_cache_manager.pool
    ids = [b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is None]
    if not ids:
        return 0
    caches = engine.runner.kv_caches
    index = torch.tensor(ids, dtype=torch.int64)
    for layer, tensor in caches.tensors.items():
        dim = KV_LAYOUTS[caches.group_kinds[caches.layer_to_group[layer]]].block_dim
        tensor.index_fill_(dim, index.to(tensor.device), value)
    return len(ids)
