"""The per-step rules (core/step_rules.py) as a table, and the scheduler keeping to them."""

from __future__ import annotations

import pytest
from core_fakes import make_request, make_scheduler
from hypothesis import given
from hypothesis import strategies as st

from warmcap.config import EngineConfig, SpeculativeConfig
from warmcap.core.outputs import ModelRunnerOutput
from warmcap.core.step_rules import computed_after_verify, step_lookahead

# (role, spec, KV loaded from outside this step) -> lookahead slots reserved
LOOKAHEAD_TABLE = [
    ("none", None, False, 0),
    ("none", "ngram:3", False, 0),
    ("none", "eagle:3", False, 3),
    ("none", "dflash:7", False, 8),
    ("producer", "eagle:3", False, 0),
    ("producer", "dflash:7", False, 0),
    # a consumer's locally computed requests (warmup, decode after the load): the full lookahead
    ("consumer", "dflash:7", False, 8),
    ("consumer", "eagle:8", False, 8),
    ("consumer", "draft_model:2", False, 2),
    # a consumer request in the step its KV is loaded from outside drafts nothing
    ("consumer", "dflash:7", True, 0),
    ("consumer", "eagle:8", True, 0),
    ("consumer", None, True, 0),
]


@pytest.mark.parametrize(("role", "spec", "loading", "want"), LOOKAHEAD_TABLE)
def test_lookahead_by_role_and_state(role: str, spec: str | None, loading: bool, want: int) -> None:
    config = EngineConfig(speculative=SpeculativeConfig.parse(spec), kv_role=role)
    assert step_lookahead(config, num_external_tokens=29 if loading else 0) == want


@given(
    computed=st.integers(0, 4096),
    drafts=st.integers(0, 16),
    data=st.data(),
)
def test_rollback_drops_exactly_the_rejected_drafts(computed: int, drafts: int, data) -> None:
    accepted = data.draw(st.integers(0, drafts))
    after = computed_after_verify(computed + drafts, drafts, accepted)
    assert after == computed + accepted
    assert computed <= after <= computed + drafts


@pytest.mark.parametrize(("drafts", "accepted"), [(3, 4), (3, -1)])
def test_rollback_refuses_impossible_acceptance(drafts: int, accepted: int) -> None:
    with pytest.raises(ValueError, match=r"accepted must be in 0\.\.drafts"):
        computed_after_verify(10, drafts, accepted)


def test_scheduler_rolls_back_rejected_drafts_and_keeps_the_blocks() -> None:
    sched = make_scheduler(spec="eagle:3", block_size=4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[1]], {"a": [2, 3, 4]}))
    out = sched.schedule()  # verify 1 + 3 tokens, reserving 3 more for the drafter
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3, 4]}
    held = {g: list(ids) for g, ids in sched.kv.get_block_ids("a").items()}
    computed = sched.requests["a"].num_computed_tokens
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[9]], {}))  # every draft rejected
    assert sched.requests["a"].num_computed_tokens == computed_after_verify(computed, 3, 0) == computed - 3
    assert sched.kv.get_block_ids("a") == held
