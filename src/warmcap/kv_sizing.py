"""How many KV blocks the pool gets: the configured count, else a memory fraction of what is free,
capped at what ``max_num_seqs`` full-length requests can use (plus the null block)."""

from __future__ import annotations

from collections.abc import Sequence

import psutil
import torch

from warmcap.config import EngineConfig
from warmcap.core.kv_spec import KVCacheGroup
from warmcap.core.reservation import blocks_per_request
from warmcap.errors import CapacityError


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available host memory (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def blocks_for_full_batch(config: EngineConfig, groups: Sequence[KVCacheGroup]) -> int:
    """Blocks ``max_num_seqs`` requests of ``max_model_len`` tokens hold at once, plus the null block."""
    per_request = blocks_per_request(
        groups,
        config.max_model_len,
        num_lookahead_tokens=config.num_lookahead_tokens,
        max_model_len=config.max_model_len,
    )
    return config.scheduler.max_num_seqs * sum(per_request.values()) + 1


def num_kv_blocks(
    config: EngineConfig,
    groups: Sequence[KVCacheGroup],
    device: torch.device,
    *,
    free_bytes: int | None = None,
) -> int:
    """The pool size (block ids, null block 0 included). ``free_bytes``: the memory left for the
    KV cache once the weights are in (default: what ``device`` has free now)."""
    bytes_per_block = sum(g.page_size_bytes for g in groups)
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    if config.cache.num_blocks is not None:
        num_blocks = config.cache.num_blocks
        if num_blocks * bytes_per_block > free:
            raise CapacityError(
                f"--num-blocks {num_blocks} needs {_gib(num_blocks * bytes_per_block)} of KV cache "
                f"({bytes_per_block} bytes per block) but only {_gib(free)} is free on {device}: "
                f"use at most {free // bytes_per_block} blocks, or leave --num-blocks unset to size by memory"
            )
        return num_blocks
    budget = int(free * config.cache.memory_fraction)
    num_blocks = min(budget // bytes_per_block, blocks_for_full_batch(config, groups))
    if num_blocks < 2:
        raise CapacityError(
            f"only {budget} bytes free for the KV cache but one block takes {bytes_per_block}: "
            "free memory, raise memory_fraction, or set num_blocks explicitly"
        )
    return num_blocks


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
