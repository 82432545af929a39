"""The compiled CPU GEMM (``kernels/cpu/gemm.c``): ``F.linear``'s product within float32's error
bound, each output the same bits whatever the batch, its neighbouring columns or the thread count,
the tensors it refuses, and a model through it generating what
oneDNN's packed product generates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from mode_rig import assert_same_generation, generate_per_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from warmcap.kernels.cpu import gemm
from warmcap.kernels.cpu.gemm import ENV, BlockedWeight, Gemm


def threads(n: int):
    """Context: torch's intra-op threads set to n (the kernel runs on that many)."""

    class _Threads:
        def __enter__(self) -> None:
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *_: object) -> None:
            torch.set_num_threads(self.before)

    return _Threads()


@settings(max_examples=80, deadline=None)
@given(
    m=st.integers(0, 40),
    k=st.sampled_from([1, 7, 64, 100, 576, 1536]),
    n=st.sampled_from([1, 15, 16, 17, 100, 960]),
    bias=st.booleans(),
    pad=st.sampled_from([0, 3]),
    n_threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_the_product_is_f_linear_within_float32_rounding(
    cpu_gemm: Gemm, m: int, k: int, n: int, bias: bool, pad: int, n_threads: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k + pad, generator=gen)[:, :k]  # a row stride wider than K, as a slice has
    with threads(n_threads), torch.inference_mode():
        got = cpu_gemm.linear(x, BlockedWeight.pack(weight, b))
    assert got is not None and got.shape == (m, n)
    exact = x.double() @ weight.double().T + (0.0 if b is None else b.double())
    # one float32 multiply-add chain of K terms, then the bias: |error| <= (K + 1) u sum|x_i w_i| + u |b|
    u = 2.0**-24
    scale = x.double().abs() @ weight.double().abs().T
    limit = (k + 2) * u * (scale + (0.0 if b is None else b.double().abs())) + 1e-30
    assert bool(((got.double() - exact).abs() <= limit).all())
    # and so from F.linear's, which obeys the same bound in its own summation order
    assert bool(((got.double() - F.linear(x, weight, b).double()).abs() <= 2 * limit).all())


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.sampled_from([8, 64, 576]),
    n=st.sampled_from([17, 100, 300]),
    picks=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_every_output_has_the_same_bits_in_any_batch_beside_any_columns_on_any_threads(
    cpu_gemm: Gemm, m: int, k: int, n: int, picks: int, seed: int
) -> None:
    """The greedy head re-scores a few vocabulary rows and must get the full head's exact values;
    a row's logits must not move with what else is in the batch."""
    gen = torch.Generator().manual_seed(seed)
    weight = BlockedWeight.pack(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    ids = torch.randint(0, n, (picks,), generator=gen)
    with torch.inference_mode():
        with threads(1):
            full = cpu_gemm.linear(x, weight)
            rows_alone = [cpu_gemm.linear(x[i : i + 1], weight) for i in range(m)]
            split = int(torch.randint(0, m + 1, (), generator=gen))
            halves = [cpu_gemm.linear(x[:split], weight), cpu_gemm.linear(x[split:], weight)]
            picked = cpu_gemm.linear(x, weight.rows(ids))
        with threads(2):
            two = cpu_gemm.linear(x, weight)
    assert full is not None and picked is not None and two is not None
    assert torch.equal(torch.cat(rows_alone), full)
    assert torch.equal(torch.cat(halves), full)
    assert torch.equal(picked, full[:, ids])
    assert torch.equal(two, full)


@settings(max_examples=50, deadline=None)
@given(
    m=st.integers(0, 40),
    k=st.sampled_from([1, 64, 576]),
    inter=st.sampled_from([16, 48, 1536]),
    bias=st.booleans(),
    log_scale=st.integers(-3, 3),
    n_threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_the_fused_silu_mul_is_silu_of_gate_times_up(
    cpu_gemm: Gemm, m: int, k: int, inter: int, bias: bool, log_scale: int, n_threads: int, seed: int
) -> None:
    """The gate and up products are the plain GEMM's own bits; SiLU's exp is within 1.02 ulp, so
    each output is within a few ulps of ``F.silu(gate) * up`` on those products."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(2 * inter, k, generator=gen) * 10.0**log_scale
    b = torch.randn(2 * inter, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    packed = BlockedWeight.pack(weight, b)
    with threads(n_threads), torch.inference_mode():
        fused = cpu_gemm.silu_mul(x, packed)
        product = cpu_gemm.linear(x, packed)
    assert fused is not None and product is not None and fused.shape == (m, inter)
    gate, up = product.double().split(inter, dim=-1)
    want = F.silu(gate) * up
    # a few float32 roundings of |silu(g) u| (exp, add, divide, multiply); below g = -87.3 e^g is
    # no normal float and silu(g) (< 1e-35) is flushed to zero, as torch's float32 SiLU does
    assert bool(((fused.double() - want).abs() <= 2.0**-21 * want.abs() + 1e-35 * up.abs()).all())


def test_the_fused_silu_mul_keeps_nan_and_infinities(cpu_gemm: Gemm) -> None:
    # rows of x picked so that gate products are NaN, +inf, -inf, huge and tiny, up products 1
    weight = torch.zeros(32, 1)
    weight[16:] = 1.0  # up = x
    weight[:16] = 1.0  # gate = x
    x = torch.tensor([[float("nan")], [float("inf")], [-float("inf")], [1e30], [-1e30], [-100.0], [0.0]])
    packed = BlockedWeight.pack(weight)
    with torch.inference_mode():
        fused = cpu_gemm.silu_mul(x, packed)
    assert fused is not None
    want = F.silu(x) * x
    got = fused[:, 0]
    assert torch.isnan(got[0]) and torch.isnan(want[0, 0])
    assert got[1] == float("inf") and got[1] == want[1, 0]
    # -inf * silu(-inf): torch's silu(-inf) is -0 * ... NaN either way; ours must not be a finite number
    assert not torch.isfinite(got[2])
    assert got[3] == want[3, 0]
    assert got[4] == 0.0 and got[6] == 0.0  # silu underflows to -0 or 0 for very negative gates
    torch.testing.assert_close(got[5], want[5, 0], rtol=1e-5, atol=0.0)


def test_the_fused_silu_mul_needs_whole_blocks(cpu_gemm: Gemm) -> None:
    packed = BlockedWeight.pack(torch.randn(2 * 24, 8))  # I = 24: up's first block is shared with gate's
    assert cpu_gemm.silu_mul(torch.randn(3, 8), packed) is None
    assert cpu_gemm.silu_mul(torch.randn(3, 8), BlockedWeight.pack(torch.randn(33, 8))) is None


def test_leading_dims_and_column_major_inputs(cpu_gemm: Gemm) -> None:
    weight = torch.randn(24, 32)
    packed = BlockedWeight.pack(weight)
    x = torch.randn(3, 5, 32)
    column_major = torch.randn(32, 6).t()
    with torch.inference_mode():
        got = cpu_gemm.linear(x, packed)
        strided = cpu_gemm.linear(column_major, packed)
    assert got is not None and got.shape == (3, 5, 24)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert strided is not None
    torch.testing.assert_close(strided, F.linear(column_major, weight), rtol=1e-5, atol=1e-5)
    dense, bias = packed.dense()
    assert torch.equal(dense, weight) and bias is None


def test_inputs_the_kernel_cannot_take_are_refused(cpu_gemm: Gemm) -> None:
    packed = BlockedWeight.pack(torch.randn(8, 16))
    assert cpu_gemm.linear(torch.randn(2, 15), packed) is None, "K must match"
    assert cpu_gemm.linear(torch.randn(2, 16).double(), packed) is None
    with torch.enable_grad():
        assert cpu_gemm.linear(torch.randn(2, 16).requires_grad_(), packed) is None, "autograd needs torch"


def test_fake_tensors_run_the_operators_fake_implementations_not_the_c_code(
    cpu_gemm: Gemm, monkeypatch
) -> None:
    monkeypatch.setattr(gemm, "_entry_points", lambda: pytest.fail("fake tensors reached the C code"))
    packed = BlockedWeight.pack(torch.randn(64, 16), torch.randn(64))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x = mode.from_tensor(torch.randn(3, 5, 16))
    with mode:
        out, fused = cpu_gemm.linear(x, packed), cpu_gemm.silu_mul(x, packed)
    assert isinstance(out, FakeTensor) and out.shape == (3, 5, 64)
    assert isinstance(fused, FakeTensor) and fused.shape == (3, 5, 32)


def test_torch_compile_traces_both_products_whole(cpu_gemm: Gemm) -> None:
    packed = BlockedWeight.pack(torch.randn(64, 16), torch.randn(64))

    def mlp(x):
        return cpu_gemm.linear(cpu_gemm.silu_mul(x, packed), BlockedWeight.pack(torch.ones(8, 32))) * 2.0

    x = torch.randn(5, 16)
    with torch.inference_mode():
        want = mlp(x)
        got = torch.compile(mlp, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, want)


def test_a_model_through_the_gemm_generates_what_onednn_generates(monkeypatch) -> None:
    from warmcap.models.packed_linear import PackedLinear

    fused: list[int] = []
    real = Gemm.silu_mul

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(Gemm, "silu_mul", spy)

    def uses_the_gemm_in_kernel_mode_only(mode: str, model: torch.nn.Module) -> None:
        linears = [m for m in model.modules() if type(m) is PackedLinear]
        assert linears
        assert all((m.gemm is not None) == (mode == "kernel") for m in linears)

    assert_same_generation(generate_per_mode(monkeypatch, ENV, uses_the_gemm_in_kernel_mode_only))
    assert fused and all(fused), "every MLP of the kernel-mode engine ran the fused SiLU"


def test_the_operator_called_directly_refuses_what_the_c_code_would_misread(cpu_gemm: Gemm) -> None:
    packed = BlockedWeight.pack(torch.randn(32, 16))
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="do not fit 32 packed features"):
        torch.ops.warmcap.gemm.default(x, packed.blocks, None, 48)
    with pytest.raises(ValueError, match="x must be float32"):
        torch.ops.warmcap.gemm.default(x.double(), packed.blocks, None, 32)
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        torch.ops.warmcap.gemm.default(x, packed.blocks.transpose(1, 2), None, 32)
