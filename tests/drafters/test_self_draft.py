"""I5: the target drafting for itself (draft_model with the target checkpoint) accepts every
draft token: acceptance length exactly 1 + k and every per-position rate 1.0."""

from __future__ import annotations

import pytest
from spec_rig import TINY_VOCAB, SpecRig, prompts


@pytest.mark.parametrize("k", [1, 3, 7])
def test_self_drafting_accepts_everything(k: int) -> None:
    vocab = TINY_VOCAB
    rig = SpecRig(spec=f"draft_model:{k}@self", record=False, max_model_len=256)
    ps = prompts(vocab, (9, 20), seed=k)
    rig.run({0: [("a", ps[0], 3 * k + 4), ("b", ps[1], 2 * k + 5)]})
    m = rig.metrics
    assert m.num_drafts > 0
    assert m.acceptance_length == 1 + k
    assert m.per_position_rates == [1.0] * k


def test_self_drafting_shares_the_targets_loaded_module_and_a_named_checkpoint_does_not(tmp_path) -> None:
    """The target drafting for itself reuses its loaded (and packed) module instead of loading the
    checkpoint a second time; a draft model named by path is still loaded on its own."""
    from warmcap.models.presets import resolve_model

    rig = SpecRig(spec="draft_model:2", record=False)
    assert rig.drafter.model is rig.model
    # Its KV still lives in groups of its own.
    assert any(g.name.startswith("draft.") for g in rig.engine.kv_groups)
    named = SpecRig(spec=f"draft_model:2@{resolve_model('tiny-llama')}", record=False)
    assert named.drafter.model is not named.model
