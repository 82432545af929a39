"""I2 for drafters: every drafter slot mapping is recorded; with the reservation's lookahead forced
to 0 (a test-only seam on the scheduler) the drafter writes outside the request's blocks — the
audit sees it — and with the correct lookahead it never does."""

from __future__ import annotations

import pytest
from spec_rig import TINY_VOCAB, SpecRig, force_acceptance, prompts


def _run(spec: str, lookahead: int | None) -> SpecRig:
    vocab = TINY_VOCAB
    rig = SpecRig(spec=spec, lookahead_override=lookahead)
    # Fully accepted drafts put the sampled token, and so the drafter's writes, furthest ahead.
    force_acceptance(rig)
    # Prompt ends just before a block boundary, so the lookahead region crosses it at once.
    ps = prompts(vocab, (14, 29), seed=3)
    rig.run({0: [("a", ps[0], 16), ("b", ps[1], 16)]})
    return rig


@pytest.mark.parametrize("spec", ["draft_model:3", "eagle:4", "dflash:3"])
def test_forced_zero_lookahead_is_caught_and_the_real_one_is_clean(spec: str) -> None:
    bad = _run(spec, lookahead=0)
    strays = bad.stray_writes()
    assert strays, "a drafter writing past an allocation without lookahead must be detected"
    assert {phase for phase, *_ in strays} <= {"draft_prefill"} | {f"draft_step_{i}" for i in range(4)}
    assert all(group.startswith("draft.") for _, group, *_ in strays)

    good = _run(spec, lookahead=None)
    assert good.stray_writes() == []
    groups = {rec.group for rec in good.runner.kv_write_log.records if rec.phase != "target"}
    assert groups == {g.name for g in good.drafter.kv_groups(16)}
