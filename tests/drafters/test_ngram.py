from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.drafters.ngram import ngram_propose


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for j in range(len(tokens) - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + k]
    return []


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_propose(tokens, min_n=1, max_n=3, k=2) == [7, 8]


def test_longer_match_wins_over_a_later_shorter_one() -> None:
    # "5 6" occurs at 0 (followed by 1); "6" alone occurs later at 4 (followed by 2).
    tokens = [5, 6, 1, 0, 6, 2, 5, 6]
    assert ngram_propose(tokens, min_n=1, max_n=2, k=1) == [1]
    assert ngram_propose(tokens, min_n=1, max_n=1, k=1) == [2]


def test_no_match_and_short_history_draft_nothing() -> None:
    assert ngram_propose([1, 2, 3, 4], min_n=1, max_n=3, k=3) == []
    assert ngram_propose([7], min_n=1, max_n=3, k=3) == []
    assert ngram_propose([], min_n=1, max_n=3, k=3) == []


def test_proposal_is_cut_at_the_end_of_the_history() -> None:
    assert ngram_propose([4, 4, 4], min_n=1, max_n=2, k=5) == [4]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 6),
)
def test_matches_brute_force(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    expected = _brute_force(tokens, min_n, min_n + extra, k)
    assert ngram_propose(tokens, min_n=min_n, max_n=min_n + extra, k=k) == expected
