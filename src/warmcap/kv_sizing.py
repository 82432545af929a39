"""How many KV blocks the pool gets: the configured count, else a memory fraction of what is free,
capped at what ``max_num_seqs`` full-length requests can use (plus the null block)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from warmcap.config import EngineConfig
from warmcap.core.kv_spec import KVCacheGroup
from warmcap.core.reservation import blocks_per_request
from warmcap.errors import CapacityError

_MEMINFO = Path("/proc/meminfo")


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available host memory (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if _MEMINFO.is_file():
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    bytes_per_block = sum(g.page_size_bytes for g in groups)
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    budget = int(free * config.cache.memory_fraction)
    num_blocks = min(budget // bytes_per_block, blocks_for_full_batch(config, groups))
    if num_blocks < 2:
        raise CapacityError(
            f"only {budget} bytes free for the KV cache but one block takes {bytes_per_block}: "
            "free memory, raise memory_fraction, or set num_blocks explicitly"
        )
    return num_blocks
