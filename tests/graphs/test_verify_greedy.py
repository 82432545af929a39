"""Graph verification's greedy check (``graphs/proof/verify.py`` ``tokens_agree``): the unpadded
reference recomputes each row another way than the replay (prefill attention from position 0, other
row counts), so its logits differ in the last bits; a token flipped at a tie that those bits explain
is not a failed graph, while any larger difference, or a flip away from a tie, still is."""

from __future__ import annotations

import torch

from warmcap.graphs.proof.verify import Passes, Tolerance, _check, tokens_agree

TOL = Tolerance(0.0, 1e-4)


def _logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, vocab, generator=g) * 10


def test_a_tie_tipped_by_last_bit_differences_agrees():
    ref = _logits()
    ref[1, 7] = ref[1].max() + 1.0
    ref[1, 9] = ref[1, 7] - 2e-5  # within the rounding of the other pass: a near tie
    rep = ref.clone()
    rep[1, 9] += 3e-5  # the replay's bits tip it: token 9 instead of 7
    assert ref[1].argmax() == 7 and rep[1].argmax() == 9
    assert bool(tokens_agree(ref, rep, TOL))


def test_a_flip_away_from_a_tie_fails():
    ref = _logits()
    rep = ref.clone()
    second = ref[0].topk(2).indices[1]
    rep[0, second] = ref[0].max() + 0.5  # far more than rounding moves a logit
    assert not bool(tokens_agree(ref, rep, TOL))


def test_a_large_difference_fails_even_at_a_tie():
    ref = _logits()
    ref[2, 3] = ref[2].max() + 1.0
    ref[2, 4] = ref[2, 3]
    rep = ref.clone()
    rep[2, 4] += 1.0  # a padding leak moves logits by O(1): the tie does not excuse it
    rep[2, 3] -= 0.5
    assert not bool(tokens_agree(ref, rep, TOL))


def test_the_check_uses_the_logits_when_the_passes_give_them():
    hidden = torch.zeros(2, 4)
    ref_logits = torch.tensor([[5.0, 5.0 - 1e-5, 0.0], [1.0, 2.0, 3.0]])
    rep_logits = torch.tensor([[5.0 - 2e-5, 5.0 - 1e-5, 0.0], [1.0, 2.0, 3.0]])
    outputs = iter([ref_logits, rep_logits])

    passes = Passes(
        num_reqs=2,
        metas={},
        reference=lambda: [hidden.clone()],
        replay=lambda: [hidden.clone()],
        padded_eager=lambda: [hidden.clone()],
        greedy=lambda out: None,  # not consulted: the logits decide
        logits=lambda out: next(outputs),
    )
    check = _check("decode", passes, [], TOL)
    assert check.verified and check.greedy_match, check.reason
