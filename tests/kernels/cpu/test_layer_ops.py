"""The compiled CPU layer ops (``kernels/cpu/layer_ops.c``) against torch's: RMSNorm (with and
without the residual add) to the last bit or two, RoPE bit for bit; where they refuse a tensor; the
``WARMCAP_CPU_LAYER_OPS`` switch; and a model through them generating what torch's ops generate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from mode_rig import assert_same_generation, generate_per_mode
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode

from warmcap.kernels.cpu import layer_ops
from warmcap.kernels.cpu.layer_ops import ENV, LayerOps
from warmcap.models.rope import RotaryEmbedding, apply_rope


@pytest.fixture(scope="session")
def ops(cpu_layer_ops: LayerOps) -> LayerOps:
    return cpu_layer_ops


def rows_view(gen: torch.Generator, rows: int, n: int, pad: int, scale: float) -> torch.Tensor:
    """[rows, n] as the left part of a wider tensor (row stride n + pad), as a fused product's slice."""
    return (torch.randn(rows, n + pad, generator=gen) * scale)[:, :n]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    n=st.sampled_from([1, 7, 16, 64, 100, 576, 960]),
    pad=st.sampled_from([0, 5, 64]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    eps=st.sampled_from([1e-6, 1e-5]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_and_the_residual_add_match_torch(ops, rows, n, pad, scale, eps, threads, seed):
    gen = torch.Generator().manual_seed(seed)
    x = rows_view(gen, rows, n, pad, scale)
    delta = rows_view(gen, rows, n, pad, scale)
    weight = torch.nn.Parameter(torch.randn(n, generator=gen))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = ops.rms_norm(x, weight, eps)
            both = ops.add_rms_norm(x, delta, weight, eps)
            want = F.rms_norm(x, (n,), weight, eps)
            h_want = x + delta
            h_norm_want = F.rms_norm(h_want, (n,), weight, eps)
    finally:
        torch.set_num_threads(before)
    assert got is not None and both is not None
    # Only the order of the sum of squares differs from torch's: a few ulps at most.
    torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-6)
    h, h_norm = both
    assert torch.equal(h, h_want), "the residual sum must be exactly x + delta"
    torch.testing.assert_close(h_norm, h_norm_want, rtol=3e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 24),
    heads=st.integers(1, 12),
    d=st.sampled_from([2, 8, 32, 64, 80, 128]),
    extra_heads=st.integers(0, 3),
    start=st.integers(0, 5000),
    seed=st.integers(0, 2**16),
)
def test_rope_in_place_equals_apply_rope_bit_for_bit(ops, tokens, heads, d, extra_heads, start, seed):
    gen = torch.Generator().manual_seed(seed)
    # A view of a fused projection: heads of a wider row (token stride > heads * d).
    fused = torch.randn(tokens, heads + extra_heads, d, generator=gen)
    x = fused[:, :heads]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rotary = RotaryEmbedding(d, "default", 10000.0, inv_freq)
    cos, sin = rotary.cos_sin(torch.arange(start, start + tokens), torch.float32)
    want = apply_rope(x, cos, sin)
    untouched = fused[:, heads:].clone()
    assert ops.rope_(x, cos, sin)
    assert torch.equal(x, want)
    assert torch.equal(fused[:, heads:], untouched), "only the given heads may change"


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 20),
    vocab=st.integers(1, 9000),
    pad=st.sampled_from([0, 3]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_the_greedy_candidate_test_is_the_bound_formula(ops, rows, vocab, pad, threads, seed):
    gen = torch.Generator().manual_seed(seed)
    approx = (torch.randn(rows, vocab + pad, generator=gen) * 4).bfloat16()[:, :vocab]
    cx = torch.rand(rows, 1, generator=gen) * 0.05
    absolute = torch.rand(rows, 1, generator=gen) * 1e-3
    norms = torch.rand(vocab, generator=gen) * 3
    scratch = torch.empty(9 * vocab, dtype=torch.uint8)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids, lo = ops.greedy_candidates(approx, cx, absolute, norms, scratch)
    finally:
        torch.set_num_threads(saved)
    # The formula of models/greedy_head.py, one float32 op at a time (no fused multiply-add).
    z = approx.float()
    spread = cx * norms
    want_lo = (z - spread).amax(dim=1, keepdim=True) - 2 * absolute
    assert torch.equal(lo, want_lo)
    assert torch.equal(ids, ((z + spread) >= want_lo).any(dim=0).nonzero().squeeze(1))
    assert ids.numel() >= 1, "each row's own maximum is always a candidate"


def test_tensors_the_kernels_cannot_take_are_refused_untouched(ops):
    x = torch.randn(4, 64)
    w = torch.randn(64)
    assert ops.rms_norm(x.double(), w.double(), 1e-5) is None
    assert ops.rms_norm(x.t().contiguous().t(), w, 1e-5) is None, "a column-major view has no unit stride"
    assert ops.rms_norm(x.view(4, 2, 32), torch.randn(32), 1e-5) is None, "rows only"
    assert ops.add_rms_norm(x, torch.randn(3, 64), w, 1e-5) is None
    with torch.enable_grad():
        assert ops.rms_norm(x.requires_grad_(), w, 1e-5) is None, "autograd must see torch's ops"
    q = torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    before = q.clone()
    assert not ops.rope_(torch.randn(3, 2, 7), torch.randn(3, 7), torch.randn(3, 7)), "odd head size"
    assert not ops.rope_(q, cos[:2], sin[:2]), "one cos/sin row per token"
    assert not ops.rope_(q.transpose(1, 2).contiguous().transpose(1, 2), cos, sin), "unit stride in D"
    assert not ops.rope_(q.double(), cos.double(), sin.double())
    assert torch.equal(q, before)
    approx, c, norms = torch.randn(2, 50).bfloat16(), torch.rand(2, 1), torch.rand(50)
    scratch = torch.empty(9 * 50, dtype=torch.uint8)
    assert ops.greedy_candidates(approx, c, c, norms, scratch) is not None
    assert ops.greedy_candidates(approx.float(), c, c, norms, scratch) is None, "the screen is bf16"
    assert ops.greedy_candidates(approx, c, c, norms[:49], scratch) is None, "one norm per id"
    assert ops.greedy_candidates(approx, c, c, norms, scratch[:-1]) is None, "scratch too small"


def test_fake_tensors_run_the_operators_fake_implementations_not_the_c_code(ops, monkeypatch):
    """The graph-safety check and torch.compile see each op as an operator with its output shapes;
    the C code never gets a tensor without data."""
    monkeypatch.setattr(layer_ops, "_c", lambda: pytest.fail("fake tensors reached the C code"))
    mode = FakeTensorMode()
    x, d, w = (mode.from_tensor(t) for t in (torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)))
    q, cos, sin = (mode.from_tensor(t) for t in (torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8)))
    approx = mode.from_tensor(torch.randn(2, 50).bfloat16())
    c, norms = mode.from_tensor(torch.rand(2, 1)), mode.from_tensor(torch.rand(50))
    scratch = mode.from_tensor(torch.empty(9 * 50, dtype=torch.uint8))
    with mode:
        out = ops.rms_norm(x, w, 1e-5)
        h, normed = ops.add_rms_norm(x, d, w, 1e-5)
        assert ops.rope_(q, cos, sin)
        # How many candidates there are depends on the data, as torch.nonzero's count does: said so,
        # as for nonzero (what the graph-safety check reports as a data-dependent shape).
        with pytest.raises(DynamicOutputShapeException, match="greedy_candidates"):
            ops.greedy_candidates(approx, c, c, norms, scratch)
    for t in (out, h, normed):
        assert isinstance(t, FakeTensor) and t.shape == (4, 64) and t.dtype == torch.float32


def test_torch_compile_traces_the_ops_whole(ops):
    """fullgraph=True fails on any graph break: norm, residual norm and the in-place RoPE are traced
    as operators and give the eager bits."""

    def layer(x, d, w, q, cos, sin):
        h, normed = ops.add_rms_norm(x, d, w, 1e-5)
        assert ops.rope_(q, cos, sin)
        return ops.rms_norm(normed, w, 1e-5), h, q * 1.0

    args = (
        torch.randn(4, 64),
        torch.randn(4, 64),
        torch.randn(64),
        torch.randn(4, 3, 8),
        torch.randn(4, 8),
        torch.randn(4, 8),
    )
    want = layer(*[a.clone() for a in args])
    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(*[a.clone() for a in args])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_model_through_the_layer_ops_generates_what_torch_ops_generate(monkeypatch):

    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm", "rope_"):
        real = getattr(LayerOps, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            result = _real(self, *args, **kwargs)
            if result is not None and result is not False:
                calls.append(_name)
            return result

        monkeypatch.setattr(LayerOps, name, spy)

    def attached_in_kernel_mode_only(mode: str, model: torch.nn.Module) -> None:
        attached = {type(m).__name__ for m in model.modules() if getattr(m, "cpu_ops", None) is not None}
        assert attached == (set() if mode == "torch" else {"RMSNorm", "LlamaAttention"})

    results = generate_per_mode(monkeypatch, ENV, attached_in_kernel_mode_only)
    assert set(calls) == {"rms_norm", "add_rms_norm", "rope_"}
    assert_same_generation(results)
