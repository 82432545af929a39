"""Pool sizing: explicit count wins; otherwise free memory, capped at a full batch of full-length requests."""

from __future__ import annotations

import pytest
import torch

import warmcap.kv_sizing as sizing
from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup
from warmcap.errors import CapacityError

GROUPS = [KVCacheGroup("full", FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8), ("l0", "l1"))]
CPU = torch.device("cpu")


def _config(num_blocks: int | None = None) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, memory_fraction=0.5),
        scheduler=SchedulerConfig(max_num_seqs=3, max_model_len=100),
    )


def test_explicit_num_blocks_wins() -> None:
    assert sizing.num_kv_blocks(_config(num_blocks=9), GROUPS, CPU) == 9


def test_capped_at_full_length_requests_plus_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 1 << 40)
    # 100 tokens in 16-token blocks = 7 blocks per request, 3 requests, + the null block.
    assert sizing.num_kv_blocks(_config(), GROUPS, CPU) == 3 * 7 + 1


def test_memory_fraction_limits_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    per_block = GROUPS[0].page_size_bytes
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 10 * per_block)
    assert sizing.num_kv_blocks(_config(), GROUPS, CPU) == 5
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: per_block)
    with pytest.raises(CapacityError, match="num_blocks"):
        sizing.num_kv_blocks(_config(), GROUPS, CPU)


def test_free_memory_is_positive_on_this_host() -> None:
    assert sizing.free_memory_bytes(CPU) > 0


def test_given_free_bytes_replace_the_device_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up passes the memory left once the weights are in (measured before they load)."""
    per_block = GROUPS[0].page_size_bytes
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 1 << 40)
    assert sizing.num_kv_blocks(_config(), GROUPS, CPU, free_bytes=8 * per_block) == 4


def test_explicit_num_blocks_beyond_free_memory_is_refused_with_the_numbers() -> None:
    # 100 million blocks of 2 KiB are ~190 GiB: more than this machine has free.
    per_block = GROUPS[0].page_size_bytes
    with pytest.raises(CapacityError, match="--num-blocks 100000000 needs") as info:
        sizing.num_kv_blocks(_config(num_blocks=100_000_000), GROUPS, CPU)
    fits = sizing.free_memory_bytes(CPU) // per_block
    assert f"use at most {fits} blocks" in str(info.value) or "use at most" in str(info.value)


def test_free_host_memory_comes_from_psutil() -> None:
    import psutil

    got = sizing.free_memory_bytes(CPU)
    assert abs(got - psutil.virtual_memory().available) < (256 << 20)
