"""I6: each drafter's proposals through the paged engine equal a plain full-recompute reference of
the same drafter on the same accepted prefix — across block boundaries, after rejections and after
partial and full acceptance (forced by editing the target's logits)."""

from __future__ import annotations

import pytest
from spec_rig import TINY_VOCAB, SpecRig, force_acceptance, prompts

from warmcap.drafters import reference


def _reference(rig: SpecRig, tokens: list[int]) -> list[int]:
    d, k, target = rig.drafter, rig.drafter.num_speculative_tokens, rig.model
    method = d.method
    if method == "draft_model":
        return reference.reference_draft_model(d.model, tokens, k)
    if method == "dflash":
        return reference.reference_dflash(d.head, target, tokens, k, d.aux_layers)
    return reference.reference_hidden_head(d.head, target, tokens, k, d.aux_layers)


@pytest.mark.parametrize("spec", ["draft_model:3@tiny-qwen3", "eagle:3", "eagle3:3", "mtp:2", "dflash:3"])
def test_paged_proposals_equal_the_full_recompute_reference(spec: str) -> None:
    vocab = TINY_VOCAB
    rig = SpecRig(spec=spec, record=False)
    force_acceptance(rig)
    ps = prompts(vocab, (14, 30, 3), seed=5)
    rig.run({0: [("a", ps[0], 14), ("b", ps[1], 10)], 2: [("c", ps[2], 12)]})
    accepted = rig.metrics.accepted_per_pos
    assert accepted and accepted[0] > 0, "forced acceptance must exercise accepted drafts"
    assert rig.metrics.num_accepted_tokens < rig.metrics.num_draft_tokens, "and rejections"
    # Proposals must cross the 16- and 32-token block boundaries.
    lengths = {len(tokens) for _, tokens, _ in rig.proposals}
    assert min(lengths) < 16 and max(lengths) > 32
    for req_id, tokens, drafts in rig.proposals:
        expected = _reference(rig, tokens)
        assert drafts == expected[: len(drafts)], f"{req_id} after {len(tokens)} tokens"
