from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.errors import ConfigError
from warmcap.graphs.capture.sizes import (
    PaddingTable,
    choose_sizes,
    compare_with_ladder,
    default_capture_sizes,
    load_histogram,
    padding_waste,
    parse_capture_sizes,
    uniform_decode_sizes,
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(0, 8))
def test_ladder_is_sorted_unique_and_capped(max_num_seqs: int, k: int) -> None:
    sizes = default_capture_sizes(max_num_seqs, k)
    cap = min(2 * max_num_seqs * (1 + k), 512)
    assert sizes == sorted(set(sizes))
    assert sizes[0] == 1
    assert sizes[-1] == cap  # the cap is always captured
    for s in sizes[:-1]:
        assert s in (1, 2, 4) or (s < 256 and s % 8 == 0) or (s >= 256 and s % 16 == 0)
    # No ladder rung below the cap is skipped.
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert [s for s in ladder if s < cap] == sizes[:-1]


def test_ladder_matches_the_usual_default() -> None:
    assert default_capture_sizes(8, 0) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(3, 2) == [1, 2, 4, 8, 16, 18]
    big = default_capture_sizes(1024, 0)
    assert big[-1] == 512 and 248 in big and 256 in big and 264 not in big and 272 in big
    assert default_capture_sizes(8, 0, max_size=6) == [1, 2, 4, 6]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8))
def test_uniform_decode_sizes_have_no_holes(max_num_seqs: int, k: int) -> None:
    sizes = uniform_decode_sizes(max_num_seqs, k)
    q = 1 + k
    assert sizes == [q * n for n in range(1, max_num_seqs + 1)]
    # Every decode step of n requests (n <= max_num_seqs) has a graph of exactly its token count.
    table = PaddingTable(sizes)
    for n in range(1, max_num_seqs + 1):
        assert table.pad(q * n) == q * n


def test_parse_capture_sizes() -> None:
    assert parse_capture_sizes(" 8, 1,4,2,4 ") == [1, 2, 4, 8]
    for bad, hint in (("1,x", "not an integer"), ("0,2", ">= 1"), ("", "empty"), ("1,,2", "empty entry")):
        with pytest.raises(ConfigError, match=hint):
            parse_capture_sizes(bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=30), st.integers(0, 700))
def test_padding_table_picks_smallest_holding_size(sizes: list[int], n: int) -> None:
    got = PaddingTable(sizes).pad(n)
    fitting = [s for s in sizes if s >= n]
    assert got == (min(fitting) if fitting else None)


def test_load_histogram_both_formats(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_text('{"num_tokens": 8, "count": 3}\n\n5\n8\n{"num_tokens": 2}\n')
    assert load_histogram(path) == {2: 1, 5: 1, 8: 4}
    path.write_text('{"num_tokens": 0, "count": 3}\n')
    with pytest.raises(ConfigError, match=r"h.jsonl:1: num_tokens"):
        load_histogram(path)
    path.write_text("nope\n")
    with pytest.raises(ConfigError, match="not JSON"):
        load_histogram(path)


def _brute_force_best(hist: dict[int, int], budget: int) -> float:
    from itertools import combinations

    values = sorted(hist)
    best = float("inf")
    rest = values[:-1]
    for b in range(0, min(budget, len(values))):
        for combo in combinations(rest, b):
            best = min(best, padding_waste(hist, [*combo, values[-1]]).padded_tokens_per_batch)
    return best


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 64), st.integers(1, 50), min_size=1, max_size=7), st.integers(1, 4))
def test_choose_sizes_is_optimal(hist: dict[int, int], budget: int) -> None:
    chosen = choose_sizes(hist, budget)
    assert len(chosen) <= budget and max(hist) in chosen and chosen == sorted(set(chosen))
    got = padding_waste(hist, chosen).padded_tokens_per_batch
    assert got == pytest.approx(_brute_force_best(hist, budget))


def test_profile_guided_beats_ladder_on_skewed_histogram() -> None:
    # Spec decode with k=2 and bursts of odd sizes: the ladder pads 3 -> 4, 9 -> 16, 27 -> 32.
    hist = {3: 5000, 6: 900, 9: 700, 27: 120, 30: 40}
    ladder = default_capture_sizes(8, 2)
    cmp = compare_with_ladder(hist, ladder)
    assert len(cmp.chosen) <= cmp.ladder.index(32) + 1
    assert cmp.chosen_waste.padded_tokens_per_batch < cmp.ladder_waste.padded_tokens_per_batch / 10
    assert cmp.saved_tokens_per_batch > 1.0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_profile_guided_never_worse_than_ladder(seed: int) -> None:
    rng = random.Random(seed)
    ladder = default_capture_sizes(rng.randint(1, 64), rng.randint(0, 3))
    counts = rng.sample(range(1, ladder[-1] + 1), k=min(ladder[-1], rng.randint(1, 12)))
    hist = {n: rng.randint(1, 1000) for n in counts}
    cmp = compare_with_ladder(hist, ladder)
    assert cmp.ladder_waste.eager_fraction == 0 and cmp.chosen_waste.eager_fraction == 0
    assert cmp.chosen_waste.padded_tokens_per_batch <= cmp.ladder_waste.padded_tokens_per_batch + 1e-9


def test_without_max_the_top_may_stay_eager() -> None:
    hist = {1: 1000, 2: 1000, 500: 1}
    assert choose_sizes(hist, 2, must_include_max=False) == [1, 2]
    assert choose_sizes(hist, 2) == [2, 500]
    waste = padding_waste(hist, [1, 2])
    assert waste.padded_tokens_per_batch == 0 and waste.eager_fraction == pytest.approx(1 / 2001)


def test_histogram_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    hist = {3: 10, 7: 2, 40: 1}
    path.write_text("\n".join(json.dumps({"num_tokens": n, "count": c}) for n, c in hist.items()))
    assert choose_sizes(load_histogram(path), 3) == [3, 7, 40]
