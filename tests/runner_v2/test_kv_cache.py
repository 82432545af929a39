"""KV tensors: layout per spec kind with the trailing sink block, scrubbing, and unknown kinds."""

from __future__ import annotations

import pytest
import torch

from warmcap.core.kv_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheGroup,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)
from warmcap.errors import ModelLoadError
from warmcap.runner_v2.kv_cache import KVCaches


def test_layout_has_a_sink_block_and_scrub_zeroes_only_given_blocks() -> None:
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8)
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, sliding_window=8)
    groups = [KVCacheGroup("full", full, ("l0", "l2")), KVCacheGroup("sliding_window", swa, ("l1",))]
    caches = KVCaches(groups, num_blocks=5, dtype=torch.float32, device="cpu")
    assert set(caches.tensors) == {"l0", "l1", "l2"}
    assert caches.tensors["l0"].shape == (2, 6, 4, 2, 8)
    assert caches.layer_to_group == {"l0": "full", "l2": "full", "l1": "sliding_window"}
    assert caches.bytes_per_block == 2 * full.page_size_bytes + swa.page_size_bytes
    for t in caches.tensors.values():
        t.fill_(1.0)
    caches.zero_blocks([1, 3], groups=["full"])
    l0 = caches.tensors["l0"]
    assert l0[:, [1, 3]].eq(0).all() and l0[:, [0, 2, 4, 5]].eq(1).all()
    assert caches.tensors["l1"].eq(1).all()
    caches.zero_blocks([2])
    assert caches.tensors["l1"][:, 2].eq(0).all()


def test_latent_indexer_and_mamba_layouts_are_scrubbed_per_block() -> None:
    mla = MLASpec(block_size=4, kv_lora_rank=6, qk_rope_head_dim=2)
    indexer = IndexerSpec(block_size=4, head_size=5)
    mamba = MambaSpec(block_size=64, state_shapes=((3, 2), (2, 2, 4)), num_speculative_blocks=1)
    groups = [
        KVCacheGroup("mla", mla, ("a",)),
        KVCacheGroup("indexer", indexer, ("a.indexer",)),
        KVCacheGroup("mamba", mamba, ("m",)),
    ]
    caches = KVCaches(groups, num_blocks=5, dtype=torch.float32, device="cpu")
    shapes = {name: tuple(t.shape) for name, t in caches.tensors.items()}
    assert shapes == {"a": (6, 4, 8), "a.indexer": (6, 4, 5), "m": (6, 6 + 16)}
    assert caches.bytes_per_block == mla.page_size_bytes + indexer.page_size_bytes + mamba.page_size_bytes
    for t in caches.tensors.values():
        t.fill_(1.0)
    caches.zero_blocks([2, 5])  # a used block and the sink
    for t in caches.tensors.values():
        assert t[[2, 5]].eq(0).all() and t[[0, 1, 3, 4]].eq(1).all()


def test_unregistered_kind_names_the_known_ones() -> None:
    group = KVCacheGroup("cross_attention", CrossAttentionSpec(block_size=4), ("l0",))
    with pytest.raises(ModelLoadError, match="known: \\['full', 'indexer', 'mamba', 'mla', 'sliding_window'"):
        KVCaches([group], num_blocks=3, dtype=torch.float32, device="cpu")


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_a_cpu_pool_reads_as_zeros_and_holds_memory_only_for_blocks_written() -> None:
    """A 2 GiB pool costs no resident memory until written; reading it costs none either; writing
    and scrubbing some blocks makes just those resident (the pool is sized for a worst case that
    serving rarely reaches)."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64)
    num_blocks = (2 << 30) // (4 * spec.page_size_bytes)  # 4 layers, 2 GiB in all
    before = _rss()
    caches = KVCaches(
        [KVCacheGroup("full", spec, ("l0", "l1", "l2", "l3"))], num_blocks, dtype=torch.float32, device="cpu"
    )
    assert caches.total_bytes >= 2 << 30
    assert _rss() - before < 64 << 20
    l0 = caches.tensors["l0"]
    assert l0.shape == (2, num_blocks + 1, 16, 4, 64) and l0.is_contiguous()
    assert all(not t.any() for t in caches.tensors.values())  # zeros, read without being touched
    assert _rss() - before < 64 << 20
    l0[:, 7] = 1.0
    caches.zero_blocks([7, 9, num_blocks])  # warmup's scrub: used blocks and the sink
    grown = _rss() - before
    assert 3 * spec.page_size_bytes <= grown < 64 << 20
    assert not l0[:, 7].any()
