"""Mamba state-slot selection: which block-table column a step reads and writes, per cache mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.contracts import AttentionMetadata
from warmcap.contracts.mamba_layout import state_views
from warmcap.core.kv_spec import MambaSpec
from warmcap.core.reservation import block_of, reserved_blocks
from warmcap.runner_v2.mamba_draft_state import draft_state_plans
from warmcap.runner_v2.mamba_state import (
    StatePlan,
    accepted_column,
    align_anchors,
    anchor_column,
    build_mamba_metadata,
    plan_state,
    prefix_column,
    probe_plan,
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


# ---- draft LM passes (draft_state_plans) and verification probes (probe_plan) -----------------


def _boundaries(sp: MambaSpec, first: int, count: int) -> dict[int, int]:
    """``all`` mode's extra writes for tokens ``0 .. count - 1`` of a span starting at ``first``."""
    if sp.cache_mode != "all":
        return {}
    return {i: block_of(sp, first + i) for i in range(count) if (first + i + 1) % sp.block_size == 0}


@pytest.mark.parametrize(
    ("mode", "before", "at", "steps"),
    [
        # bs 4, k 3; 9 known tokens: positions 0..7 computed, 8 just sampled. Spans: 0..4 (before
        # the known tokens), 5..8 (ends at the sampled token), then draft steps at 9 and 10.
        ("none", ((4, 0),), ((2, 0), (3, 1)), [(1, ((0, 2),)), (2, ())]),
        # anchor = block of position 7 = 1; a span ending at position 4 leaves its state in block 1.
        ("align", ((4, 1),), ((2, 1), (3, 2)), [(2, ((0, 3),)), (3, ())]),
        # As align, plus the boundary after position 3 (block 0) crossed by the first span.
        ("all", ((3, 0), (4, 1)), ((2, 1), (3, 2)), [(2, ((0, 3),)), (3, ())]),
    ],
)
def test_draft_lm_plans_worked_example(mode: str, before: tuple, at: tuple, steps: list) -> None:
    sp = spec(mode, k=3)
    first = draft_state_plans(sp, [0], [5], [9])[0]
    assert first.read_column is None and first.writes == before
    read_from = 0 if mode == "none" else 1  # the first span's last state, after position 4
    assert draft_state_plans(sp, [5], [4], [9]) == [StatePlan(read_from, at)]
    for position, (read, writes) in zip((9, 10), steps, strict=True):
        assert draft_state_plans(sp, [position], [1], [9]) == [StatePlan(read, writes)]


def test_all_mode_draft_prefill_does_not_store_the_sampled_tokens_state_at_its_boundary() -> None:
    """Position 7 (just sampled) ends block 1, but it is re-fed next step: block 1 gets the state
    after position 6 (the anchor), and the state after 7 goes to anchor + 1, as a draft's would."""
    plan = draft_state_plans(spec("all", k=2), [0], [8], [8])[0]
    assert plan.writes == ((3, 0), (6, 1), (7, 2))


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(["none", "all", "align"]),
    k=st.integers(1, 4),
    bs=st.integers(1, 8),
    c=st.integers(0, 40),
    s=st.integers(2, 20),
    gap=st.integers(0, 5),
)
def test_draft_lm_plans_follow_the_documented_columns(
    mode: str, k: int, bs: int, c: int, s: int, gap: int
) -> None:
    """A span ending ``gap`` tokens before the known tokens (0: at the sampled token), then the
    draft steps past them: reads and writes as the docstring states, and each draft step reads the
    column the pass before it wrote its last state to."""
    sp = spec(mode, k=k, bs=bs)
    known = c + s + gap
    (plan,) = draft_state_plans(sp, [c], [s], [known])
    assert plan.read_column == (anchor_column(sp, c) if c else None)
    if gap:
        expected = _boundaries(sp, c, s) | {s - 1: anchor_column(sp, c + s)}
    else:
        sampled = known - 1
        anchor = anchor_column(sp, sampled)
        expected = _boundaries(sp, c, s - 1) | {s - 2: anchor, s - 1: anchor + 1}
    assert plan.writes == tuple(sorted(expected.items()))
    if gap:
        return
    last = plan.writes[-1][1]
    for i in range(1, k):
        (step,) = draft_state_plans(sp, [sampled + i], [1], [known])
        assert step.read_column == anchor + i == last
        if i < k - 1:
            assert step.writes == ((0, anchor + i + 1),)
            last = anchor + i + 1
        else:
            assert step.writes == ()


@pytest.mark.parametrize(
    ("mode", "with_context", "from_zero"),
    [
        # bs 4: a probe after 9 tokens reads the state after position 8 and, running positions
        # 9..11, writes the state after 11; one of 6 tokens from zero writes the state after 5.
        # Mode none keeps one committed state: the probe writes the very column it reads.
        ("none", StatePlan(0, ((2, 0),)), StatePlan(None, ((5, 0),))),
        ("align", StatePlan(2, ((2, 2),)), StatePlan(None, ((5, 1),))),
        # As align, plus the state at each block boundary crossed (after positions 11 and 3).
        ("all", StatePlan(2, ((2, 2),)), StatePlan(None, ((3, 0), (5, 1)))),
    ],
)
def test_probe_reads_its_anchor_and_writes_like_a_committed_step(
    mode: str, with_context: StatePlan, from_zero: StatePlan
) -> None:
    sp = spec(mode, k=2)
    assert probe_plan(sp, 9, 3) == with_context
    assert probe_plan(sp, 0, 6) == from_zero


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(["none", "all", "align"]),
    bs=st.integers(1, 8),
    c=st.integers(1, 40),
    s=st.integers(1, 20),
)
def test_a_probe_continuing_a_probe_reads_the_state_the_first_one_left(
    mode: str, bs: int, c: int, s: int
) -> None:
    """Verification writes a row's context with a probe from zero, then runs a probe after it: the
    second reads the column the first stored its last state in, and stores its own last state
    where a third probe would read it."""
    sp = spec(mode, k=2, bs=bs)
    context = probe_plan(sp, 0, c)
    step = probe_plan(sp, c, s)
    assert context.read_column is None
    assert step.read_column == context.writes[-1][1]
    assert context.writes[-1][0] == c - 1 and step.writes[-1][0] == s - 1
    assert probe_plan(sp, c + s, 1).read_column == step.writes[-1][1]


def test_align_anchor_is_read_off_the_table_and_survives_a_shorter_step() -> None:
    # bs 4, k 2: a target's align table ends in the running state's and the 2 draft states'
    # columns, whatever this step schedules (after rejected drafts it may schedule fewer tokens
    # than the step that grew the table); a padded row holds only null blocks.
    sp = spec("align", k=2)
    table = torch.tensor([[0, 5, 6, 7, 0, 0], [0, 0, 9, 0, 3, 4], [0, 0, 0, 0, 0, 0]])
    assert align_anchors(sp, table) == [1, 3, -1]
    plan = plan_state(
        sp, num_computed_tokens=9, num_scheduled_tokens=2, num_spec_tokens=1, live_column=2, anchor=3
    )
    # the state after the committed token goes to the anchor, the draft's to the next column,
    # although the block of token 10 is column 2
    assert plan == StatePlan(2, ((0, 3), (1, 4)))
