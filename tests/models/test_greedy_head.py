"""The screened greedy head: its argmax equals ``row_argmax`` of the full float32 logits, on random
heads with near-ties built on purpose and on SmolLM2's real head and hidden states; the bf16
screen stays inside the bound the module proves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from warmcap.kernels.cpu.gemm import Gemm
from warmcap.kernels.cpu.layer_ops import LayerOps
from warmcap.models.greedy_head import GreedyHead, bound_coefficient
from warmcap.models.loader import load_model
from warmcap.models.packed_linear import prepack_linears, unpack_linears
from warmcap.models.presets import resolve_model
from warmcap.runner_v2.sampler import row_argmax

#: on CPUs without oneDNN bf16 the head is tested as the portable screen (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("screen_on_every_cpu")


def packed_head(weight: torch.Tensor, gemm: Gemm | bool = True) -> nn.Linear:
    """A float32 head packed as the loader packs it (``gemm``: the compiled GEMM's layout, or False
    for oneDNN's)."""
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = nn.Parameter(weight, requires_grad=False)
    assert prepack_linears(head, gemm=gemm) == 1
    return head


def full_argmax(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the runner samples without the screen: ``row_argmax`` of the model's float32 logits."""
    return row_argmax(head(x).float())


def exact_error_ratio(head: GreedyHead, x: torch.Tensor) -> float:
    """max over rows and tokens of |screen - exact| / (||x|| ||w_v||) (exact: float64 products)."""
    approx = head.approximate(x)
    exact = x.double() @ head.weight.double().T
    scale = x.double().norm(dim=1, keepdim=True) * head.weight.double().norm(dim=1)
    return float(((approx.double() - exact).abs() / scale.clamp_min(1e-300)).max())


def check_exact(head: nn.Module, greedy: GreedyHead, x: torch.Tensor) -> None:
    want = full_argmax(head, x)
    got = greedy.argmax(x)
    assert got is not None
    assert torch.equal(got, want)
    screen = greedy.screen(x)
    assert screen is not None
    # every row's full-GEMM argmax is among its own candidates
    position = torch.searchsorted(screen.ids, want)
    assert torch.equal(screen.ids[position], want)
    assert bool(screen.member[torch.arange(len(x)), position].all())


@settings(max_examples=60, deadline=None)
@given(
    compiled=st.booleans(),
    blocked=st.booleans(),
    vocab=st.integers(64, 3000),
    hidden=st.sampled_from([16, 64, 576]),
    rows=st.integers(1, 20),
    log_scale=st.integers(-12, 12),
    ties=st.sampled_from(["none", "duplicate", "one_ulp", "zero_rows"]),
    seed=st.integers(0, 2**16),
)
def test_screened_argmax_equals_the_full_float32_argmax(
    cpu_layer_ops: LayerOps,
    cpu_gemm: Gemm,
    compiled: bool,
    blocked: bool,
    vocab: int,
    hidden: int,
    rows: int,
    log_scale: int,
    ties: str,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * torch.rand(vocab, 1, generator=gen) * 0.2
    x = torch.randn(rows, hidden, generator=gen) * 10.0**log_scale
    # Make row 0's winner a planted token, then copy it to a later id: exactly, or 1 ulp apart.
    planted = int(torch.randint(0, vocab // 2, (), generator=gen))
    weight[planted] = x[0] / x[0].norm() * 0.5
    copy = int(torch.randint(vocab // 2, vocab, (), generator=gen))
    if ties == "duplicate":
        weight[copy] = weight[planted]  # a tie: the lowest id wins, as torch.argmax
    elif ties == "one_ulp":
        weight[copy] = weight[planted]
        i = int(x[0].abs().argmax())
        weight[copy, i] = torch.nextafter(weight[copy, i], weight[copy, i] + torch.sign(x[0, i]))
    elif ties == "zero_rows":
        weight[: vocab // 3] = 0.0  # unused ids: exact zeros, b_v = the absolute term only
        weight[planted] = x[0] / x[0].norm() * 0.5
    head = packed_head(weight, cpu_gemm if blocked else False)
    greedy = GreedyHead.build(head, cpu_layer_ops if compiled else None)
    assert greedy is not None
    with torch.inference_mode():
        check_exact(head, greedy, x)
        assert exact_error_ratio(greedy, x) <= bound_coefficient(hidden)
        if blocked:
            # the compiled GEMM gives a column the same bits beside any others: the re-score is
            # the full head's own float32 values (oneDNN's is checked on SmolLM2 below)
            screen = greedy.screen(x)
            assert screen is not None
            assert torch.equal(greedy.rescore(x, screen.ids), head(x)[:, screen.ids])


def test_the_compiled_candidate_test_finds_what_torch_ops_find(cpu_layer_ops: LayerOps) -> None:
    gen = torch.Generator().manual_seed(3)
    head = packed_head(torch.randn(3000, 64, generator=gen) * 0.1)
    compiled, plain = GreedyHead.build(head, cpu_layer_ops), GreedyHead.build(head)
    assert compiled is not None and plain is not None
    with torch.inference_mode():
        for rows in (1, 5, 16, 37):  # 37: past one 16-row chunk of torch's passes
            x = torch.randn(rows, 64, generator=gen)
            a, b = compiled.screen(x), plain.screen(x)
            assert a is not None and b is not None
            assert torch.equal(a.ids, b.ids) and torch.equal(a.member, b.member)
            assert torch.equal(compiled.argmax(x), plain.argmax(x))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_tie_goes_to_the_lowest_id(cpu_layer_ops: LayerOps, compiled: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 64, generator=gen) * 0.01
    x = torch.randn(3, 64, generator=gen)
    for row, winner in enumerate((7, 300, 500)):
        weight[winner] = x[row] / x[row].norm()
        weight[winner + 5] = weight[winner]
    head = packed_head(weight)
    greedy = GreedyHead.build(head, cpu_layer_ops if compiled else None)
    assert greedy is not None
    with torch.inference_mode():
        assert greedy.argmax(x).tolist() == [7, 300, 500]
        assert full_argmax(head, x).tolist() == [7, 300, 500]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e36, 0.0])
def test_rows_outside_the_bound_take_the_full_logits(cpu_layer_ops: LayerOps, bad: float) -> None:
    head = packed_head(torch.randn(256, 32))
    greedy = GreedyHead.build(head, cpu_layer_ops)
    assert greedy is not None
    x = torch.randn(4, 32)
    x[2] = bad
    with torch.inference_mode():
        assert greedy.screen(x) is None and greedy.argmax(x) is None
        assert greedy.argmax(x[:2]) is not None


def test_heads_it_cannot_screen_exactly_get_none() -> None:
    with_bias = nn.Linear(16, 64)
    prepack_linears(with_bias)
    assert GreedyHead.build(with_bias) is None
    assert GreedyHead.build(nn.Linear(16, 64, bias=False)) is None  # not packed
    nan = torch.randn(64, 16)
    nan[3, 3] = float("nan")
    assert GreedyHead.build(packed_head(nan)) is None
    head = packed_head(torch.randn(64, 16))
    greedy = GreedyHead.build(head)
    assert greedy is not None and greedy.usable()
    unpack_linears(head)  # the full path now runs F.linear: the re-score would not match it
    assert not greedy.usable() and greedy.argmax(torch.randn(2, 16)) is None


@pytest.fixture(scope="module")
def smollm2() -> nn.Module:
    return load_model(resolve_model("smollm2-135m"))


def smollm2_hidden(model: nn.Module) -> torch.Tensor:
    """Final-normed hidden states of SmolLM2 over two natural texts (transformers computes them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    texts = [
        "The capital of France is Paris, and the capital of Germany is Berlin. Both cities",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    ]
    with torch.no_grad():
        return torch.cat([hf.model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0] for t in texts])


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_screened_argmax_equals_the_full_head(smollm2: nn.Module) -> None:
    greedy = smollm2.greedy_head()
    assert greedy is not None
    assert greedy.weight.data_ptr() == smollm2.model.embed_tokens.weight.data_ptr()  # tied: shared
    hidden = smollm2_hidden(smollm2)
    with torch.inference_mode():
        for start in range(0, len(hidden), 16):
            check_exact(smollm2.lm_head, greedy, hidden[start : start + 16])
        assert exact_error_ratio(greedy, hidden) <= bound_coefficient(greedy.hidden_size)
        # the re-score is the full GEMM's own float32 values, bit for bit
        screen = greedy.screen(hidden)
        assert screen is not None and screen.ids.numel() < 2000
        full = smollm2.compute_logits(hidden)
        assert torch.equal(greedy.rescore(hidden, screen.ids), full[:, screen.ids])
        # ... and so is it where the head is packed for oneDNN (no compiler, WARMCAP_CPU_GEMM=torch)
        onednn = packed_head(smollm2.lm_head.weight.detach(), gemm=False)
        onednn_greedy = GreedyHead.build(onednn)
        assert onednn_greedy is not None
        assert torch.equal(onednn_greedy.rescore(hidden, screen.ids), onednn(hidden)[:, screen.ids])
        # near-ties on real rows: move each row along w_b - w_a until its top two tokens a, b have
        # the same real logit; float32 then separates them by a few ulps at most
        top2 = full.topk(2, dim=1).indices
        w = smollm2.lm_head.weight.detach()
        diff = w[top2[:, 1]] - w[top2[:, 0]]
        gap = (hidden * -diff).sum(dim=1, keepdim=True)
        tied = hidden + gap / diff.square().sum(dim=1, keepdim=True) * diff
        logits = smollm2.compute_logits(tied)
        near = logits.gather(1, top2).diff(dim=1).abs().squeeze(1)
        assert float(near.median()) < 1e-4  # they are near-ties indeed
        for start in range(0, len(tied), 16):
            check_exact(smollm2.lm_head, greedy, tied[start : start + 16])
