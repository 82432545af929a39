from __future__ import annotations

import pickle
import random

import pytest
from core_fakes import FakeRunner, make_request, make_scheduler, run_to_completion

from warmcap.core import kv_cache_manager
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)
from warmcap.core.request import Request
from warmcap.errors import ConfigError

FULL = KVCacheGroup("full", FullAttentionSpec(block_size=4))


def manager(*groups: KVCacheGroup, num_blocks: int = 32, max_model_len: int = 64, **kw) -> KVCacheManager:
    return KVCacheManager(list(groups or [FULL]), num_blocks, max_model_len=max_model_len, **kw)


def prefill(kv: KVCacheManager, req: Request, *, lookahead: int = 0) -> dict[str, list[int]] | None:
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(
        req,
        req.num_tokens - num_hit,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_lookahead_tokens=lookahead,
    )
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return new


def test_needs_a_group():
    with pytest.raises(ConfigError, match="at least one KV cache group"):
        KVCacheManager([], 8, max_model_len=16)


def test_decode_reserves_lookahead_and_crosses_block_boundaries():
    kv = manager()
    req = Request("a", list(range(6)))
    assert prefill(kv, req, lookahead=3) == {"full": [1, 2, 3]}  # cdiv(6 + 3, 4)
    req.output_token_ids.append(9)
    # verify step with 3 drafts: 6 computed + 4 scheduled + 3 lookahead = 13 tokens -> 4 blocks
    assert kv.allocate_slots(req, 4, num_lookahead_tokens=3) == {"full": [4]}
    assert kv.num_held_blocks("a") == {"full": 4}


def test_lookahead_is_capped_by_max_model_len():
    kv = manager(max_model_len=8)
    req = Request("a", list(range(6)))
    assert prefill(kv, req, lookahead=8) == {"full": [1, 2]}


def test_rejection_keeps_the_extra_blocks():
    kv = manager()
    req = Request("a", list(range(7)))
    prefill(kv, req, lookahead=3)
    req.output_token_ids.append(1)
    kv.allocate_slots(req, 4, num_lookahead_tokens=3)  # 7 + 4 + 3 = 14 -> 4 blocks
    req.num_computed_tokens = 8  # every draft rejected
    assert kv.allocate_slots(req, 1, num_lookahead_tokens=3) == {"full": []}  # 12 -> 3, keeps 4
    assert kv.num_held_blocks("a") == {"full": 4}


def test_the_shared_no_new_blocks_result_is_read_only_and_pickles():
    # A decode step that needs no block gets the one shared result; a TP broadcast pickles it.
    kv = manager()
    first, a, b = (Request(name, list(range(6))) for name in ("first", "a", "b"))
    for req in (first, a, b):
        prefill(kv, req)
        req.output_token_ids.append(1)
    kv.allocate_running(first, 1, 0)  # the first of its size works the count out
    none_a, none_b = kv.allocate_running(a, 1, 0), kv.allocate_running(b, 1, 0)
    assert none_a == none_b == {"full": []}
    assert none_a is none_b
    with pytest.raises(TypeError, match="read-only"):
        none_a["full"] = [7]
    with pytest.raises(TypeError, match="read-only"):
        none_a.update(full=[7])
    copy = pickle.loads(pickle.dumps(none_a))
    assert copy == {"full": []} and type(copy) is type(none_a)
    with pytest.raises(TypeError, match="read-only"):
        copy.pop("full")


def test_failed_allocation_changes_nothing():
    kv = manager(FULL, KVCacheGroup("mla", MLASpec(block_size=4)), num_blocks=7)
    a, b = Request("a", list(range(8))), Request("b", list(range(100, 108)))
    prefill(kv, a)
    before = kv.pool.snapshot(), kv.get_block_ids("b")
    # b needs 2 + 2 blocks; 2 are free: neither group may take any
    assert prefill(kv, b) is None
    assert (kv.pool.snapshot(), kv.get_block_ids("b")) == before


def test_prefix_hits_share_full_blocks_and_leave_the_last_token():
    kv = manager()
    first = Request("a", list(range(10)))
    prefill(kv, first)
    second = Request("b", [*range(9), 99])
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8 and hits == {"full": kv.get_block_ids("a")["full"][:2]}
    # A prompt equal to a cached one still leaves its last block to compute.
    twin = Request("c", list(range(8)))
    assert kv.get_computed_blocks(twin)[1] == 4
    prefill(kv, second)
    assert kv.get_block_ids("b")["full"][:2] == kv.get_block_ids("a")["full"][:2]
    assert kv.pool.blocks[kv.get_block_ids("a")["full"][0]].ref_cnt == 2
    stats = kv.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_freed_blocks_stay_cached_until_evicted():
    kv = manager(num_blocks=5)
    a = Request("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    again = Request("a2", list(range(9)))
    assert kv.get_computed_blocks(again)[1] == 8
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(again)[1] == 0


def test_drafts_and_lookahead_are_never_cached():
    kv = manager()
    req = Request("a", list(range(4)))
    prefill(kv, req, lookahead=4)
    assert kv.pool.num_cached_blocks == 1
    req.output_token_ids.append(4)
    # 4 computed + (1 real token + 3 drafts) would fill block 1, but only token 4 is real
    kv.allocate_slots(req, 4, num_lookahead_tokens=4)
    assert kv.pool.num_cached_blocks == 1
    drafty = Request("c", [0, 1, 2, 3, 4, 7, 7, 7, 9])  # had the drafts been 7, 7, 7
    assert kv.get_computed_blocks(drafty)[1] == 4
    # the drafts 5, 6, 7 are accepted (+ bonus 8): block 1 is now real and is cached next step
    req.output_token_ids.extend([5, 6, 7, 8])
    req.num_computed_tokens = 8
    kv.allocate_slots(req, 1, num_lookahead_tokens=4)
    assert kv.get_computed_blocks(Request("d", [*range(8), 99]))[1] == 8


def test_drafter_groups_recompute_the_last_hit_block():
    drafter = KVCacheGroup("draft.full", FullAttentionSpec(block_size=4), is_drafter=True)
    kv = manager(FULL, drafter)
    prefill(kv, Request("a", list(range(13))))
    assert kv.get_computed_blocks(Request("b", list(range(13))))[1] == 8


def test_sliding_window_releases_old_blocks_to_the_null_block():
    group = KVCacheGroup("sliding_window", SlidingWindowSpec(block_size=4, sliding_window=4))
    kv = manager(group, num_blocks=8)
    req = Request("a", list(range(12)))
    prefill(kv, req)
    assert kv.get_block_ids("a") == {"sliding_window": [1, 2, 3]}
    req.output_token_ids.append(5)
    # next query at 12 sees 9..12: block 0 and 1 (tokens 0..7) can go
    kv.allocate_slots(req, 1)
    ids = kv.get_block_ids("a")["sliding_window"]
    assert ids[:2] == [0, 0] and len(ids) == 4
    assert kv.pool.num_free_blocks == 8 - 1 - 2
    kv.free(req)
    assert kv.pool.num_free_blocks == 7


def test_mamba_modes_follow_the_rule():
    for mode, expected in (("none", 1 + 2), ("all", 1 + 2), ("align", 1 + 2)):
        group = KVCacheGroup("mamba", MambaSpec(block_size=16, cache_mode=mode, num_speculative_blocks=2))
        kv = manager(group)
        req = Request("a", list(range(10)))
        prefill(kv, req, lookahead=2)
        assert kv.num_held_blocks("a") == {"mamba": expected}
    # align ignores the lookahead even across a block boundary
    align = KVCacheGroup("mamba", MambaSpec(block_size=16, cache_mode="align", num_speculative_blocks=2))
    kv = manager(align)
    prefill(kv, Request("b", list(range(15))), lookahead=5)
    assert kv.num_held_blocks("b") == {"mamba": 1 + 2}


def test_mamba_disables_prefix_caching_for_every_group():
    kv = manager(FULL, KVCacheGroup("mamba", MambaSpec(block_size=4)))
    assert not kv.enable_caching
    prefill(kv, Request("a", list(range(9))))
    assert kv.get_computed_blocks(Request("b", list(range(9))))[1] == 0


@pytest.mark.parametrize("mode", ["none", "all", "align"])
def test_hybrid_prefix_caching_asked_for_is_refused_naming_the_mode(mode):
    mamba = KVCacheGroup("mamba", MambaSpec(block_size=4, cache_mode=mode))
    with pytest.raises(ConfigError, match=f"cache mode {mode!r}.*enable_prefix_caching=False"):
        manager(FULL, mamba, enable_caching=True)


@pytest.mark.parametrize("mode", ["all", "align"])
def test_hybrid_prefix_caching_left_to_default_is_off_in_one_line(mode, caplog):
    with caplog.at_level("INFO", logger="warmcap.core.kv_cache_manager"):
        kv = manager(FULL, KVCacheGroup("mamba", MambaSpec(block_size=4, cache_mode=mode)))
    assert not kv.enable_caching
    assert f"cache mode {mode!r}" in kv.caching_off_reason
    lines = [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()]
    assert lines == [f"prefix caching is off: {kv.caching_off_reason}"] and "\n" not in lines[0]


def test_default_prefix_caching_is_on_for_attention_only_models():
    kv = manager(FULL)
    assert kv.enable_caching and kv.caching_off_reason == ""
    prefill(kv, Request("a", list(range(9))))
    assert kv.get_computed_blocks(Request("b", list(range(9))))[1] > 0


def test_no_refusal_when_caching_was_not_asked_for(caplog):
    with caplog.at_level("WARNING", logger="warmcap.core.kv_cache_manager"):
        kv = manager(
            FULL, KVCacheGroup("mamba", MambaSpec(block_size=4, cache_mode="all")), enable_caching=False
        )
    assert kv.caching_off_reason == "" and "prefix caching" not in caplog.text


def test_cross_attention_is_sized_once_by_the_encoder():
    cross = KVCacheGroup("cross_attention", CrossAttentionSpec(block_size=4))
    kv = manager(FULL, cross, max_encoder_len=16)
    req = Request("a", [1, 2], num_encoder_tokens=10)
    prefill(kv, req)
    assert kv.num_held_blocks("a") == {"full": 1, "cross_attention": 3}
    req.output_token_ids.append(4)
    kv.allocate_slots(req, 1)
    assert kv.num_held_blocks("a")["cross_attention"] == 3
    assert kv.blocks_needed(2, num_lookahead_tokens=0) == 1 + 4  # planner sizes by max_encoder_len


def test_external_tokens_get_blocks_but_no_prefix_hit_accounting():
    kv = manager()
    req = Request("a", list(range(12)), num_external_computed_tokens=11)
    new = kv.allocate_slots(req, 1, num_external_computed_tokens=11)
    assert new == {"full": [1, 2, 3]}
    assert kv.stats.prefix_cache_hits == 0


def test_free_returns_tails_first_so_prefix_heads_survive_longest():
    kv = manager(num_blocks=6)
    req = Request("a", list(range(17)))
    prefill(kv, req)
    ids = kv.get_block_ids("a")["full"]
    kv.free(req)
    # the hashless partial tail goes first, then cached blocks from the tail back to the head
    assert kv.pool.snapshot().free_order == tuple(reversed(ids))


def test_unknown_kv_spec_kinds_are_refused():
    with pytest.raises(ConfigError, match=r"no block strategy for KV spec kind\(s\) \['base'\]"):
        KVCacheManager([KVCacheGroup("x", KVSpec(block_size=4))], 8, max_model_len=16)


def test_block_count_memo_eviction_changes_nothing(monkeypatch):
    def run() -> list:
        sched = make_scheduler(spec="eagle3:3", block_size=4, num_blocks=24, max_num_batched_tokens=32)
        for i in range(6):
            sched.add_request(make_request(f"r{i}", [i % 2] * (5 + 3 * i), max_tokens=12))
        outputs = run_to_completion(sched, FakeRunner(random.Random(1), k=3))
        assert sched.kv.pool.num_free_blocks == 23
        return [*outputs, sched.num_preemptions, sched.kv.stats]

    reference = run()
    # A memo of one entry starts over on nearly every lookup.
    monkeypatch.setattr(kv_cache_manager, "_MAX_MEMO", 1)
    assert run() == reference
