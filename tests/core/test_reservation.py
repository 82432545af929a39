"""The reservation rule against the reference engine's facts (docs/warmup.md) and the lookahead table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.config import EngineConfig, SpeculativeConfig
from warmcap.core.kv_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheGroup,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)
from warmcap.core.reservation import (
    block_of,
    blocks_per_request,
    max_blocks_per_request,
    reserved_blocks,
    skipped_blocks,
)


@pytest.mark.parametrize(
    ("method", "k", "lookahead"),
    [
        ("dflash", 7, 8),
        ("dflash", 1, 2),
        ("ngram", 3, 0),
        ("eagle", 3, 3),
        ("eagle3", 5, 5),
        ("mtp", 1, 1),
        ("draft_model", 4, 4),
    ],
)
def test_lookahead_table(method, k, lookahead):
    config = EngineConfig(speculative=SpeculativeConfig(method=method, num_speculative_tokens=k))
    assert config.num_lookahead_tokens == lookahead
    assert config.uniform_decode_query_len == 1 + k
    producer = EngineConfig(speculative=config.speculative, kv_role="producer")
    assert producer.num_lookahead_tokens == 0
    assert producer.uniform_decode_query_len == 1


def test_no_speculation_means_no_lookahead():
    config = EngineConfig()
    assert (config.num_lookahead_tokens, config.uniform_decode_query_len) == (0, 1)


def ceil_div_reference(a: int, b: int) -> int:
    """A second, independent ceiling: count blocks by walking positions."""
    return len({p // b for p in range(a)})


@settings(max_examples=200, deadline=None)
@given(
    bs=st.sampled_from([1, 2, 4, 8, 16, 32]),
    n=st.integers(0, 300),
    lookahead=st.integers(0, 17),
    max_model_len=st.integers(1, 300),
    k=st.integers(0, 16),
    encoder=st.integers(0, 300),
)
def test_rule_matches_reference_facts(bs, n, lookahead, max_model_len, k, encoder):
    capped = ceil_div_reference(min(n + lookahead, max_model_len), bs)
    for spec in (
        FullAttentionSpec(bs),
        SlidingWindowSpec(bs, sliding_window=8),
        MLASpec(bs),
        IndexerSpec(bs),
    ):
        assert reserved_blocks(spec, n, num_lookahead_tokens=lookahead, max_model_len=max_model_len) == capped
    for mode in ("none", "all"):
        spec = MambaSpec(bs, cache_mode=mode, num_speculative_blocks=k)
        assert (
            reserved_blocks(spec, n, num_lookahead_tokens=lookahead, max_model_len=max_model_len)
            == capped + k
        )
    align = MambaSpec(bs, cache_mode="align", num_speculative_blocks=k)
    assert reserved_blocks(align, n, num_lookahead_tokens=lookahead, max_model_len=max_model_len) == (
        ceil_div_reference(n, bs) + k
    )
    cross = CrossAttentionSpec(bs)
    assert reserved_blocks(
        cross, n, num_lookahead_tokens=lookahead, max_model_len=max_model_len, max_encoder_len=encoder
    ) == ceil_div_reference(encoder, bs)


def test_rule_rejects_negative_counts():
    with pytest.raises(ValueError, match="token counts must be >= 0"):
        reserved_blocks(FullAttentionSpec(16), -1, num_lookahead_tokens=0, max_model_len=8)


def test_sliding_window_skips_only_blocks_wholly_outside_the_window():
    spec = SlidingWindowSpec(block_size=4, sliding_window=4)
    # query at 12 sees 9..12: tokens 0..7 (blocks 0, 1) are out, block 2 (8..11) is partly in
    assert skipped_blocks(spec, 12) == 2
    assert skipped_blocks(spec, 3) == 0
    assert skipped_blocks(FullAttentionSpec(4), 100) == 0


def test_block_of_and_table_width():
    spec = FullAttentionSpec(block_size=16)
    assert [block_of(spec, p) for p in (0, 15, 16, 33)] == [0, 0, 1, 2]
    groups = [KVCacheGroup("full", spec), KVCacheGroup("mamba", MambaSpec(16, num_speculative_blocks=3))]
    assert blocks_per_request(groups, 17, num_lookahead_tokens=3, max_model_len=64) == {"full": 2, "mamba": 5}
    assert max_blocks_per_request(groups, num_lookahead_tokens=3, max_model_len=64) == 4 + 3
