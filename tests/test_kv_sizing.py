"""Pool sizing: explicit count wins; otherwise free memory, capped at a full batch of full-length requests."""

from __future__ import annotations

import pytest
import torch

import warmcap.kv_sizing as sizing
from warmcap.config import CacheConfig, EngineConfig, SchedulerConfig
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup
from warmcap.errors import CapacityError, ConfigError

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


# ---- a fixed KV space: the CPU default (vLLM's VLLM_CPU_KVCACHE_SPACE), or --kv-cache-space ----

GIB = 1 << 30


def _roomy(space_gib: float | None = None, memory_fraction: float = 0.9) -> EngineConfig:
    """A full batch far beyond any space here (1000 requests of 100k tokens), so only the space
    or the memory limits the pool."""
    return EngineConfig(
        cache=CacheConfig(block_size=16, kv_cache_space_gib=space_gib, memory_fraction=memory_fraction),
        scheduler=SchedulerConfig(max_num_seqs=1000, max_model_len=100_000),
    )


def test_cpu_pool_defaults_to_4_gib_however_much_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sizing.CPU_KV_SPACE_ENV, raising=False)
    per_block = GROUPS[0].page_size_bytes
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 1 << 40)
    assert sizing.num_kv_blocks(_roomy(), GROUPS, CPU) == 4 * GIB // per_block


def test_cpu_default_space_never_takes_more_than_the_memory_fraction_of_what_is_free(monkeypatch) -> None:
    monkeypatch.delenv(sizing.CPU_KV_SPACE_ENV, raising=False)
    per_block = GROUPS[0].page_size_bytes
    free = 2 * GIB
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: free)
    assert sizing.num_kv_blocks(_roomy(memory_fraction=0.5), GROUPS, CPU) == GIB // per_block


def test_the_vllm_environment_variable_sets_the_cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    per_block = GROUPS[0].page_size_bytes
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 1 << 40)
    monkeypatch.setenv(sizing.CPU_KV_SPACE_ENV, "0.5")
    assert sizing.num_kv_blocks(_roomy(), GROUPS, CPU) == GIB // 2 // per_block
    # the option wins over the variable
    assert sizing.num_kv_blocks(_roomy(space_gib=0.25), GROUPS, CPU) == GIB // 4 // per_block
    for bad in ("four", "0", "-2"):
        monkeypatch.setenv(sizing.CPU_KV_SPACE_ENV, bad)
        with pytest.raises(ConfigError, match=f"VLLM_CPU_KVCACHE_SPACE='{bad}' is not a positive number"):
            sizing.num_kv_blocks(_roomy(), GROUPS, CPU)


def test_an_explicit_space_beyond_free_memory_is_refused_with_the_numbers(monkeypatch) -> None:
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 3 * GIB)
    with pytest.raises(CapacityError, match=r"--kv-cache-space 8 GiB .* 3.00 GiB free .* at most 3.00"):
        sizing.num_kv_blocks(_roomy(space_gib=8), GROUPS, CPU)


def test_the_space_is_still_capped_at_a_full_batch_of_full_length_requests(monkeypatch) -> None:
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 1 << 40)
    config = EngineConfig(
        cache=CacheConfig(block_size=16, kv_cache_space_gib=4),
        scheduler=SchedulerConfig(max_num_seqs=3, max_model_len=100),
    )
    assert sizing.num_kv_blocks(config, GROUPS, CPU) == 3 * 7 + 1


def test_cuda_keeps_the_memory_fraction_unless_a_space_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sizing.CPU_KV_SPACE_ENV, "0.001")  # a CPU variable: CUDA ignores it
    per_block = GROUPS[0].page_size_bytes
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 10 * GIB)
    cuda = torch.device("cuda")
    assert sizing.num_kv_blocks(_roomy(memory_fraction=0.5), GROUPS, cuda) == 5 * GIB // per_block
    assert sizing.num_kv_blocks(_roomy(space_gib=1), GROUPS, cuda) == GIB // per_block


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kv_cache_space_gib": 0}, "kv_cache_space_gib must be a positive number of GiB"),
        ({"kv_cache_space_gib": -1.5}, "kv_cache_space_gib must be a positive number of GiB"),
        ({"kv_cache_space_gib": 1, "num_blocks": 64}, "both size the KV pool: pass only one"),
    ],
)
def test_bad_space_settings_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        CacheConfig(**kwargs)
