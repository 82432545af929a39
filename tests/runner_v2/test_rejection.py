from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.runner_v2.rejection import greedy_verify, num_accepted_drafts, probabilistic_verify

VOCAB = 6
P1 = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
Q1 = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.10, 0.10])
P2 = torch.tensor([0.10, 0.10, 0.50, 0.05, 0.05, 0.20])
Q2 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.20, 0.10])


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic of ``counts`` against ``probs``."""
    counts = counts.double()
    expected = probs.double() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(probs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def _reference_greedy(argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    out, row = [], 0
    for d in drafts:
        emitted = []
        for j, tok in enumerate(d):
            if argmax[row + j] != tok:
                break
            emitted.append(tok)
        emitted.append(argmax[row + len(emitted)])
        out.append(emitted)
        row += len(d) + 1
    return out


def test_greedy_accepts_prefix_then_corrects_or_adds_bonus() -> None:
    drafts = [[5, 6, 7], [1, 2], [], [9]]
    # Rows per request: its drafts, then the bonus position.
    argmax = torch.tensor([5, 6, 8, 0, 3, 2, 4, 11, 9, 12])
    assert greedy_verify(argmax, drafts) == [[5, 6, 8], [3], [11], [9, 12]]
    assert num_accepted_drafts([[5, 6, 8], [3], [11], [9, 12]]) == [2, 0, 0, 1]


def test_greedy_rejects_everything_after_the_first_mismatch() -> None:
    # Position 1 mismatches; position 2 would match again but must not count.
    assert greedy_verify(torch.tensor([4, 0, 6, 7]), [[4, 5, 6]]) == [[4, 0]]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_matches_a_per_token_reference(data: st.DataObject) -> None:
    drafts = data.draw(st.lists(st.lists(st.integers(0, 3), max_size=5), min_size=1, max_size=6))
    total = sum(len(d) + 1 for d in drafts)
    argmax = data.draw(st.lists(st.integers(0, 3), min_size=total, max_size=total))
    assert greedy_verify(torch.tensor(argmax), drafts) == _reference_greedy(argmax, drafts)


def test_row_count_mismatch_is_reported() -> None:
    try:
        greedy_verify(torch.tensor([1, 2]), [[1, 2]])
    except ValueError as exc:
        assert "3" in str(exc)
    else:
        raise AssertionError("a short target tensor must be rejected")


def _sample_drafts(q: torch.Tensor, n: int) -> torch.Tensor:
    return torch.multinomial(q, n, replacement=True)


def test_k1_output_follows_the_target_distribution() -> None:
    torch.manual_seed(0)
    n = 20_000
    drafts = _sample_drafts(Q1, n)
    target = torch.stack([P1, P2]).repeat(n, 1)  # rows: draft position, bonus position
    out = probabilistic_verify(target, Q1.repeat(n, 1), [[int(x)] for x in drafts])
    first = torch.tensor([o[0] for o in out])
    assert _chi_square_p_value(torch.bincount(first, minlength=VOCAB), P1) > 1e-3
    # The bonus (drawn after an accept) follows the target's last row.
    bonus = torch.tensor([o[1] for o in out if len(o) == 2])
    assert _chi_square_p_value(torch.bincount(bonus, minlength=VOCAB), P2) > 1e-3
    # Acceptance rate of speculative sampling is sum(min(p, q)).
    accepted = sum(num_accepted_drafts(out)) / n
    assert abs(accepted - float(torch.minimum(P1, Q1).sum())) < 0.015


def test_k1_against_a_one_hot_draft_follows_the_target_distribution() -> None:
    torch.manual_seed(1)
    n = 20_000
    out = probabilistic_verify(torch.stack([P1, P2]).repeat(n, 1), None, [[3]] * n)
    first = torch.tensor([o[0] for o in out])
    assert _chi_square_p_value(torch.bincount(first, minlength=VOCAB), P1) > 1e-3
    assert abs(sum(num_accepted_drafts(out)) / n - float(P1[3])) < 0.015


def test_k2_first_and_second_positions_follow_the_target() -> None:
    torch.manual_seed(2)
    n = 20_000
    drafts = torch.stack([_sample_drafts(Q1, n), _sample_drafts(Q2, n)], dim=1)
    target = torch.stack([P1, P2, P1]).repeat(n, 1)
    out = probabilistic_verify(target, torch.stack([Q1, Q2]).repeat(n, 1), drafts.tolist())
    first = torch.tensor([o[0] for o in out])
    assert _chi_square_p_value(torch.bincount(first, minlength=VOCAB), P1) > 1e-3
    # Given the first draft was accepted, the second token is a fresh draw from p at position 2.
    second = torch.tensor([o[1] for o in out if len(o) >= 2])
    assert second.numel() > 3000
    assert _chi_square_p_value(torch.bincount(second, minlength=VOCAB), P2) > 1e-3


def test_wrong_distribution_is_detected_by_the_chi_square_check() -> None:
    torch.manual_seed(3)
    samples = torch.multinomial(Q1, 20_000, replacement=True)
    assert _chi_square_p_value(torch.bincount(samples, minlength=VOCAB), P1) < 1e-3


def _seeded(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def test_seeded_request_samples_the_same_whatever_the_batch() -> None:
    probs = torch.softmax(torch.randn(3, 50, generator=_seeded(7)), dim=-1)
    q = torch.softmax(torch.randn(2, 50, generator=_seeded(8)), dim=-1)
    drafts = [[4, 9]]
    alone = [probabilistic_verify(probs, q, drafts, [_seeded(42)]) for _ in range(3)]
    assert alone[0] == alone[1] == alone[2]
    other_p = torch.softmax(torch.randn(2, 50), dim=-1)
    other_q = torch.softmax(torch.randn(1, 50), dim=-1)
    batched = probabilistic_verify(
        torch.cat([other_p, probs]), torch.cat([other_q, q]), [[1], *drafts], [None, _seeded(42)]
    )
    assert batched[1] == alone[0][0]


def test_different_seeds_give_different_samples() -> None:
    probs = torch.full((1, 1000), 1e-3)
    outs = {tuple(probabilistic_verify(probs, None, [[]], [_seeded(s)])[0]) for s in range(20)}
    assert len(outs) > 15


def test_zero_probability_tokens_are_never_emitted() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.manual_seed(4)
    for _ in range(200):
        out = probabilistic_verify(p, q, [[0]])[0]
        assert out in ([1], [2])


def test_draft_equal_to_target_is_always_accepted() -> None:
    torch.manual_seed(5)
    p = torch.softmax(torch.randn(4, 30), dim=-1)
    for _ in range(100):
        drafts = [torch.multinomial(p[j], 1).item() for j in range(3)]
        out = probabilistic_verify(p, p[:3], [drafts])[0]
        assert out[:3] == drafts and len(out) == 4
