"""KV tensors: layout per spec kind with the trailing sink block, scrubbing, and unknown kinds."""

from __future__ import annotations

import pytest
import torch

from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup, MLASpec, SlidingWindowSpec
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


def test_unregistered_kind_names_the_known_ones() -> None:
    group = KVCacheGroup("mla", MLASpec(block_size=4), ("l0",))
    with pytest.raises(ModelLoadError, match="known: \\['full', 'sliding_window'"):
        KVCaches([group], num_blocks=3, dtype=torch.float32, device="cpu")
