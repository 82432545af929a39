"""Sampler: greedy is argmax, seeds are batch-independent, top-k/top-p/min-p restrict support."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from warmcap.runner_v2.sampler import Sampler, SamplingMetadata, row_argmax


def _meta(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None):
    return SamplingMetadata.from_rows(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        min_p=torch.full((n,), min_p),
        generators=generators or [None] * n,
    )


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50)
    assert torch.equal(Sampler()(logits, _meta(6, temperature=0.0)), logits.argmax(-1))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.sampled_from([3, 4095, 4096, 5000, 8192, 49152, 49153]),
    seed=st.integers(0, 2**31 - 1),
    specials=st.lists(
        st.tuples(st.integers(0, 4), st.floats(0, 1), st.sampled_from(["max", "nan", "inf", "-inf", "tie"])),
        max_size=8,
    ),
)
def test_row_argmax_equals_argmax(rows: int, cols: int, seed: int, specials: list) -> None:
    """The blocked CPU argmax picks argmax's index: the first maximum (ties across and inside
    blocks, the short last block), NaN counted as the maximum, rows that are all -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    for row, where, kind in specials:
        row, col = row % rows, min(int(where * cols), cols - 1)
        if kind == "tie":
            x[row, col] = x[row, -1] = x[row].max() + 1
        elif kind == "-inf":
            x[row] = float("-inf")
        else:
            x[row, col] = {"max": 1e4, "nan": float("nan"), "inf": float("inf")}[kind]
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(4, 50)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    meta = _meta(4)
    meta = SamplingMetadata.from_rows(temperature, meta.top_k, meta.top_p, meta.min_p, meta.generators)
    out = Sampler(_gen(1))(logits, meta)
    assert out[::2].tolist() == logits.argmax(-1)[::2].tolist()


def test_seeded_request_samples_the_same_whatever_the_batch() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 40)

    def run(others: int) -> list[int]:
        logits = torch.cat([torch.randn(others, 40), row])
        gens = [None] * others + [_gen(1234)]
        sampler = Sampler(_gen(100 + others))
        return [int(sampler(logits, _meta(others + 1, generators=gens))[-1]) for _ in range(20)]

    alone, with_three, with_seven = run(0), run(3), run(7)
    assert alone == with_three == with_seven
    assert len(set(alone)) > 1  # it really samples


def _empirical_support(logits: torch.Tensor, meta: SamplingMetadata, draws: int = 4000) -> set[int]:
    sampler = Sampler(_gen(7))
    batch = logits.expand(draws, -1)
    full = SamplingMetadata.from_rows(
        meta.temperature.expand(draws),
        meta.top_k.expand(draws),
        meta.top_p.expand(draws),
        meta.min_p.expand(draws),
        [None] * draws,
    )
    return set(sampler(batch, full).tolist())


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]])
    assert _empirical_support(logits, _meta(1, top_k=3)) == {1, 3, 5}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # 0.5 + 0.3 < 0.85 so the third token is needed; the fourth is not.
    assert _empirical_support(probs.log(), _meta(1, top_p=0.85)) == {0, 1, 2}
    assert _empirical_support(probs.log(), _meta(1, top_p=0.5)) == {0}


def test_min_p_drops_tokens_below_fraction_of_the_max() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.19, 0.11]])
    assert _empirical_support(probs.log(), _meta(1, min_p=0.3)) == {0, 1, 2}


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(_gen(3))
    out = sampler(probs.log().expand(20000, -1), _meta(20000))
    freq = torch.bincount(out, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.02)


def test_the_races_noise_is_exp1_and_follows_its_generator() -> None:
    """The exponential race's noise (``sampler.exponential``): Exp(1) draws, every one > 0 (a zero
    would divide a probability by nothing), the same stream for the same seed."""
    import math

    from warmcap.runner_v2.sampler import exponential

    x = exponential(torch.empty(400_000), _gen(11))
    assert bool((x > 0).all())
    assert abs(x.mean().item() - 1.0) < 0.01 and abs(x.var().item() - 1.0) < 0.02
    for t in (0.5, 2.0, 5.0):
        assert abs((x > t).double().mean().item() - math.exp(-t)) < 0.004, t
    assert torch.equal(exponential(torch.empty(64), _gen(5)), exponential(torch.empty(64), _gen(5)))
