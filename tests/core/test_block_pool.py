from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.core.block_pool import NULL_BLOCK_ID, BlockPool
from warmcap.errors import CapacityError


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    with pytest.raises(CapacityError, match="asked for 1 KV blocks but only 0 are free"):
        pool.get_new_blocks(1)


def test_pool_needs_room_for_the_null_block():
    with pytest.raises(CapacityError, match="got 1"):
        BlockPool(1)


def test_free_returns_blocks_and_usage_tracks_them():
    pool = BlockPool(9)
    blocks = pool.get_new_blocks(4)
    assert pool.usage == pytest.approx(0.5)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0


def test_double_free_and_null_free_are_assertion_errors():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free_blocks([block])
    with pytest.raises(AssertionError, match="null block"):
        pool.free_blocks([pool.null_block])


def test_lru_order_evicts_oldest_cached_block_first():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks("full", [a, b, c], [10, 11, 12])
    pool.free_blocks([c, b, a])  # a request frees its tail first
    (first,) = pool.get_new_blocks(1)
    assert first is c
    assert pool.get_cached_block(12, "full") is None  # evicted with the block
    assert pool.get_cached_block(11, "full") is b


def test_hashless_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks("full", [a], [7])
    pool.free_blocks([a])
    pool.free_blocks([b, c])
    taken = pool.get_new_blocks(2)
    assert a not in taken
    assert pool.get_cached_block(7, "full") is a


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks("full", [a], [5])
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2
    pool.touch([pool.get_cached_block(5, "full")])
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 1
    pool.touch([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1


def test_cache_keys_are_per_group_and_first_owner_wins():
    pool = BlockPool(5)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks("full", [a], [1])
    pool.cache_full_blocks("full", [b], [1])  # same prefix computed twice: b stays private
    pool.cache_full_blocks("mla", [c], [1])
    assert pool.get_cached_block(1, "full") is a
    assert b.block_hash is None
    assert pool.get_cached_block(1, "mla") is c


def test_caching_disabled_caches_nothing():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks("full", [a], [1])
    assert pool.get_cached_block(1, "full") is None


def test_snapshot_detects_every_kind_of_change():
    pool = BlockPool(6)
    before = pool.snapshot()
    assert before == pool.snapshot()
    blocks = pool.get_new_blocks(2)
    after_take = pool.snapshot()
    assert after_take != before
    pool.cache_full_blocks("full", blocks, [3, 4])
    pool.free_blocks(reversed(blocks))
    after_free = pool.snapshot()
    assert after_free.ref_counts == before.ref_counts
    assert after_free != before  # cached hashes and queue order remain
    assert any("prefix cache" in d for d in after_free.differences(before))
    assert pool.reset_prefix_cache() == 2
    assert pool.snapshot().cached == ()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["take", "free", "touch", "cache"]), st.integers(0, 4)), max_size=60)
)
def test_random_operations_keep_the_pool_consistent(ops):
    pool = BlockPool(8)
    held: list = []
    for op, n in ops:
        if op == "take" and n <= pool.num_free_blocks:
            held.extend(pool.get_new_blocks(n))
        elif op == "free" and held:
            pool.free_blocks([held.pop(n % len(held))])
        elif op == "touch" and held:
            block = held[n % len(held)]
            pool.touch([block])
            held.append(block)
        elif op == "cache" and held:
            pool.cache_full_blocks("full", [held[n % len(held)]], [n])
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        assert pool.null_block.ref_cnt == 0 and NULL_BLOCK_ID not in pool.snapshot().free_order
        assert pool.num_free_blocks == sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0)
    pool.free_blocks(held)
    assert pool.num_free_blocks == pool.num_blocks - 1
