"""Mamba state-slot selection: which block-table column a step reads and writes, per cache mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.core.kv_spec import MambaSpec
from warmcap.core.reservation import reserved_blocks
from warmcap.runner_v2.attention.base import AttentionMetadata
from warmcap.runner_v2.mamba_state import (
    accepted_column,
    build_mamba_metadata,
    plan_state,
    prefix_column,
    state_views,
)


def spec(mode: str, k: int = 0, bs: int = 4) -> MambaSpec:
    return MambaSpec(bs, state_shapes=((3, 2), (2, 2, 2)), cache_mode=mode, num_speculative_blocks=k)


def test_none_mode_keeps_states_in_the_first_1_plus_k_columns() -> None:
    s = spec("none", k=2)
    plan = plan_state(s, num_computed_tokens=9, num_scheduled_tokens=3, num_spec_tokens=2, live_column=1)
    assert plan.read_column == 1
    assert plan.writes == ((0, 0), (1, 1), (2, 2))
    assert accepted_column(s, 10, 2) == 1


def test_align_mode_anchors_on_the_block_of_the_last_committed_token() -> None:
    s = spec("align", k=2)
    # computed 9, verify 3 (1 + 2 drafts): last committed token is position 9, block 2.
    plan = plan_state(s, num_computed_tokens=9, num_scheduled_tokens=3, num_spec_tokens=2, live_column=2)
    assert plan.writes == ((0, 2), (1, 3), (2, 4))
    assert accepted_column(s, 10, 3) == 4


def test_all_mode_also_writes_every_crossed_block_boundary() -> None:
    plan = plan_state(
        spec("all"), num_computed_tokens=2, num_scheduled_tokens=9, num_spec_tokens=0, live_column=0
    )
    # positions 2..10: boundaries after positions 3 and 7 (columns 0, 1); the live state at column 2.
    assert plan.writes == ((1, 0), (5, 1), (8, 2))
    assert plan_state(
        spec("align"), num_computed_tokens=2, num_scheduled_tokens=9, num_spec_tokens=0, live_column=0
    ).writes == ((8, 2),)


def test_new_request_starts_from_zero_state_and_prefix_hits_read_their_block() -> None:
    assert (
        plan_state(
            spec("all"), num_computed_tokens=0, num_scheduled_tokens=5, num_spec_tokens=0, live_column=None
        ).read_column
        is None
    )
    assert prefix_column(spec("all"), 8) == 1
    assert prefix_column(spec("none"), 8) is None
    with pytest.raises(ValueError, match="live state"):
        plan_state(
            spec("none"), num_computed_tokens=3, num_scheduled_tokens=1, num_spec_tokens=0, live_column=None
        )
    with pytest.raises(ValueError, match="num_spec_tokens"):
        plan_state(
            spec("none", k=1), num_computed_tokens=3, num_scheduled_tokens=3, num_spec_tokens=2, live_column=0
        )


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(["none", "all", "align"]),
    k=st.integers(0, 4),
    bs=st.integers(1, 8),
    c=st.integers(0, 60),
    s=st.integers(1, 20),
    data=st.data(),
)
def test_every_state_column_lies_in_a_block_the_rule_reserves(
    mode: str, k: int, bs: int, c: int, s: int, data
) -> None:
    """Reads, writes and the post-acceptance live column never need a block the reservation rule
    does not give (invariant I2 for Mamba groups)."""
    sp = spec(mode, k=k, bs=bs)
    d = data.draw(st.integers(0, min(k, s - 1)))
    held = reserved_blocks(sp, c + s, num_lookahead_tokens=0, max_model_len=10**6)
    previous = reserved_blocks(sp, c, num_lookahead_tokens=0, max_model_len=10**6) if c else 0
    live = data.draw(st.integers(0, previous - 1)) if c else None
    plan = plan_state(sp, num_computed_tokens=c, num_scheduled_tokens=s, num_spec_tokens=d, live_column=live)
    assert all(0 <= col < held for _, col in plan.writes)
    assert sorted({i for i, _ in plan.writes}) == [i for i, _ in plan.writes]
    assert {i for i, _ in plan.writes} >= set(range(s - 1 - d, s))
    a = data.draw(st.integers(1, 1 + d))
    assert accepted_column(sp, c + s - d, a) == dict(plan.writes)[s - 1 - d + a - 1]


def test_metadata_maps_columns_to_block_ids_and_views_split_the_state() -> None:
    table = torch.tensor([[7, 3, 9], [5, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    meta = AttentionMetadata(
        3, 2, qsl, torch.tensor([6, 1], dtype=torch.int32), table, torch.full((3,), -1), 2, 6, 4, qsl
    )
    plans = [
        plan_state(
            spec("align", k=1),
            num_computed_tokens=4,
            num_scheduled_tokens=2,
            num_spec_tokens=1,
            live_column=0,
        ),
        plan_state(
            spec("align", k=1),
            num_computed_tokens=0,
            num_scheduled_tokens=1,
            num_spec_tokens=0,
            live_column=None,
        ),
    ]
    mm = build_mamba_metadata(meta, plans)
    assert mm.read_blocks.tolist() == [7, -1]
    assert mm.write_blocks.tolist() == [3, 9, 5]
    state = torch.arange(4 * 14, dtype=torch.float32).view(4, 14)
    conv, ssm = state_views(state, ((3, 2), (2, 2, 2)))
    assert conv.shape == (4, 3, 2) and ssm.shape == (4, 2, 2, 2)
    ssm[1].fill_(-1)
    assert torch.all(state[1, 6:] == -1) and torch.all(state[1, :6] >= 0)
