"""How many KV blocks the pool gets: the configured count; else a fixed KV space (on CPU by default,
as vLLM's CPU build takes one) or, on CUDA, a memory fraction of what is free; capped at what
``max_num_seqs`` full-length requests can use (plus the null block).

On CPU the pool's pages are not touched until a request writes them (``runner_v2/kv_cache.py``),
so the space is an upper bound on the KV memory, not memory taken at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence

import psutil
import torch

from warmcap import env
from warmcap.config import DEFAULT_CPU_KV_CACHE_SPACE_GIB, EngineConfig
from warmcap.core.kv_spec import KVCacheGroup
from warmcap.core.reservation import blocks_per_request
from warmcap.errors import CapacityError, ConfigError

#: vLLM's variable for the CPU KV space in GiB, honoured as the default of ``kv_cache_space``
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
_GIB = 1 << 30


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
    advice = "free memory, raise memory_fraction, or set num_blocks explicitly"
    space = kv_cache_space(config, device)
    if space is not None:
        gib, source = space
        wanted = int(gib * _GIB)
        if source != "default" and wanted > free:
            raise CapacityError(
                f"{source} {gib:g} GiB of KV cache is more than the {_gib(free)} free on {device} once "
                f"the weights are in: lower it to at most {free / _GIB:.2f}"
            )
        if source != "default" or wanted <= budget:
            # The default space never takes more than the memory fraction of what is free.
            budget = wanted
            advice = f"raise {'--kv-cache-space' if source == 'default' else source}"
    num_blocks = min(budget // bytes_per_block, blocks_for_full_batch(config, groups))
    if num_blocks < 2:
        raise CapacityError(
            f"only {budget} bytes for the KV cache but one block takes {bytes_per_block}: {advice}"
        )
    return num_blocks


def kv_cache_space(config: EngineConfig, device: torch.device) -> tuple[float, str] | None:
    """The fixed KV space in GiB and where it was set (``--kv-cache-space``, the environment
    variable, or ``default``); None where the pool is a memory fraction instead (CUDA, unless the
    option is given)."""
    gib = config.cache.kv_cache_space_gib
    if gib is not None:
        return float(gib), "--kv-cache-space"
    if device.type == "cuda":
        return None
    text = env.read(CPU_KV_SPACE_ENV)
    if not text:
        return DEFAULT_CPU_KV_CACHE_SPACE_GIB, "default"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"{CPU_KV_SPACE_ENV}={text!r} is not a positive number of GiB: set it to e.g. 4, or unset it"
        )
    return value, CPU_KV_SPACE_ENV


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
