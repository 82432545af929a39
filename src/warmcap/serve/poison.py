"""Fill every free, uncached KV block with a poison value: a debugging check that an engine never
reads, at a position its attention can see, KV it did not write or load. ``warmup serve
--poison-free-kv`` applies it once start-up is done.

NOTE: the poison is NaN. Attention gathers whole blocks, so it reads positions past a request's
length (a free block's NaN left in the unwritten tail of a page it now holds, a window's released
columns); every reader zeroes those positions before the softmax and the value product
(``runner_v2/attention/torch_paged.py``, ``runner_v2/attention/latent_cache.py``, DFlash's block
attention), so they change nothing. A NaN read at a *visible* position spreads to the logits,
which the engine's non-finite check turns into an error, or changes the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from warmcap.runner_v2.kv_cache import KV_LAYOUTS

if TYPE_CHECKING:
    from warmcap.engine import LLMEngine

#: what a poisoned block holds in every element
POISON = float("nan")


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
