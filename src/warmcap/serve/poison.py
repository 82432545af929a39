"""Fill every free, uncached KV block with a poison value: a debugging check that an engine never
reads, at a position its attention can see, KV it did not write or load. ``warmup serve
--poison-free-kv`` applies it once start-up is done.

NOTE: the poison is a large finite number, not NaN. Attention gathers whole blocks and masks the
positions past a request's length with -inf before the softmax; their weight is then exactly 0, but
``0 * NaN`` is NaN, so NaN would flag those harmless masked reads too. A large value read at a
*visible* position dominates its softmax row and changes the output, which a comparison with an
unpoisoned engine catches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from warmcap.runner_v2.kv_cache import KV_LAYOUTS

if TYPE_CHECKING:
    from warmcap.engine import LLMEngine

#: what a poisoned block holds in every element
POISON = 1.0e4


def poison_free_blocks(engine: LLMEngine, value: float = POISON) -> int:
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
