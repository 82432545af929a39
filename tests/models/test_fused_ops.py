"""The fused Triton ops (``models/fused_ops.py``, kernels in ``kernels/triton/layer_ops.py``) against
torch's reference ops, run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``): RMSNorm with and without the residual add, SiLU-and-multiply, RoPE with
the paged KV write (PAD slots to the sink), the greedy argmax and its head; the tensors each op
refuses; the custom ops on fake tensors (what a graph-safety check or ``torch.compile`` sees).

float32 and float16 match torch to the last bit or two; bfloat16 only within a few bf16 ulps,
because Triton's interpreter rounds float32 to bfloat16 by truncation where torch (and Triton on a
GPU) rounds to nearest; ``scripts/gpu_check.py`` (the ``fused_ops`` check) compares the compiled
kernels on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from warmcap.models.fused_ops import FusedGreedyHead, FusedOps, fused_ops_for
from warmcap.models.layers import RMSNorm
from warmcap.models.rope import apply_rope
from warmcap.runner_v2.attention.torch_paged import write_kv

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    return FusedOps(CPU)


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances against torch: float32/float16 a couple of ulps; bfloat16 a few ulps (the
    interpreter's truncating casts)."""
    return {
        torch.float32: {"rtol": 3e-6, "atol": 1e-6},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 4 * 2**-8, "atol": 4 * 2**-8},
    }[dtype]


def rows_view(gen: torch.Generator, rows: int, n: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, n] as the left part of a wider tensor (row stride n + pad), as a fused product's slice."""
    return torch.randn(rows, n + pad, generator=gen).to(dtype)[:, :n]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 6),
    n=st.sampled_from([1, 7, 16, 64, 100]),
    pad=st.sampled_from([0, 5]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_and_the_residual_add_match_torch(ops, rows, n, pad, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, delta = rows_view(gen, rows, n, pad, dtype), rows_view(gen, rows, n, pad, dtype)
    norm = RMSNorm(n, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=gen) + 0.5)
        got = ops.rms_norm(x, norm.weight, norm.eps)
        both = ops.add_rms_norm(x, delta, norm.weight, norm.eps)
        want = norm(x)
        h_want = x + delta
        h_norm_want = norm(h_want)
    assert got is not None and both is not None
    torch.testing.assert_close(got, want, **tol(dtype))
    h, h_norm = both
    if dtype != torch.bfloat16:
        assert torch.equal(h, h_want), "the residual sum must be exactly x + delta"
    torch.testing.assert_close(h, h_want, **tol(dtype))
    torch.testing.assert_close(h_norm, h_norm_want, **tol(dtype))


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.sampled_from([1, 9, 64, 1100]),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([0.1, 1.0, 20.0]),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_matches_torch(ops, rows, n, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    both = (torch.randn(rows, 2 * n, generator=gen) * scale).to(dtype)
    gate, up = both[:, :n], both[:, n:]  # halves of one product, as a packed gate/up GEMM gives them
    got = ops.silu_mul(gate, up)
    assert got is not None
    torch.testing.assert_close(got, F.silu(gate) * up, **tol(dtype))


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([2, 8, 16, 24]),
    block_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rope_write_kv_rotates_and_writes_what_the_backend_would(
    ops, t, kv_heads, group, d, block_size, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    hq, blocks = kv_heads * group, 8  # at least t real slots, whatever the block size
    # q/k/v as column slices of one [T, (Hq + 2 Hkv) D] product, as a packed q/k/v GEMM gives them.
    qkv = torch.randn(t, (hq + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (hq + kv_heads) * d :].view(t, kv_heads, d)
    angles = torch.rand(t, d // 2, generator=gen) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    # Distinct real slots in the real blocks, some PAD (-1), and a longer (padded) slot mapping.
    real = torch.randperm((blocks - 1) * block_size, generator=gen)[:t]
    pad = torch.rand(t, generator=gen) < 0.3
    slots = torch.cat((torch.where(pad, -1, real), torch.full((3,), -1))).to(torch.int64)
    cache = torch.full((2, blocks, block_size, kv_heads, d), float("nan"), dtype=dtype)
    want_cache = cache.clone()
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(want_cache, want_k, v, slots)

    assert ops.rope_write_kv(q, k, v, cos, sin, cache, slots)
    torch.testing.assert_close(q, want_q, **tol(dtype))
    torch.testing.assert_close(k, want_k, **tol(dtype))
    # Every slot the backend writes is written (NaN elsewhere stays NaN: nothing else is touched).
    torch.testing.assert_close(cache, want_cache, equal_nan=True, **tol(dtype))
    if dtype != torch.bfloat16:
        assert torch.equal(q, want_q) and torch.equal(k, want_k)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 4),
    n=st.sampled_from([1, 5, 2048, 5000]),
    dtype=st.sampled_from(DTYPES),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_greedy_argmax_is_the_first_maximum(ops, rows, n, dtype, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, n, generator=gen).to(dtype)
    if ties:
        logits[:, n // 3] = 50.0
        logits[:, n - 1] = 50.0
    got = ops.greedy_argmax(logits)
    assert got is not None
    assert torch.equal(got, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_greedy_argmax_flags_a_non_finite_row(ops, bad):
    logits = torch.randn(3, 3000)
    logits[1, 2500] = bad
    got = ops.greedy_argmax(logits)
    assert got is not None
    assert got[1] == -1
    assert torch.equal(got[[0, 2]], logits[[0, 2]].argmax(dim=-1))


def test_fused_greedy_head_gives_the_full_logits_argmax_or_declines(ops):
    torch.manual_seed(0)
    head = nn.Linear(16, 300, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    greedy = FusedGreedyHead(head, ops)
    with torch.no_grad():
        got = greedy.argmax(x)
        want = head(x).float().argmax(dim=-1)
        x[2, 0] = float("nan")
        declined = greedy.argmax(x)
    assert got is not None and torch.equal(got, want)
    # Declined on the device, no host read here: the runner sees the -1 in its one token fetch and
    # sends the step to the full logits.
    assert declined is not None and declined[2] == -1, "a non-finite row must be marked declined"
    assert torch.equal(declined[[0, 1, 3]], want[[0, 1, 3]])
    assert FusedGreedyHead.declines_on_device


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_linears_are_one_gemm_over_views_of_their_weights(ops, bias):
    from warmcap.models.fused_ops import StackedLinear

    torch.manual_seed(0)
    linears = [nn.Linear(12, n, bias=bias).to(torch.bfloat16) for n in (8, 4, 4)]
    x = torch.randn(3, 12, dtype=torch.bfloat16)
    with torch.no_grad():
        want = [lin(x) for lin in linears]
        stack = StackedLinear.of(linears, ops)
        assert stack is not None
        got = stack(x)
        # The parameters are rows of the stacked weight: no second copy, the same checkpoint names.
        assert all(lin.weight.untyped_storage().data_ptr() == stack.weight.data_ptr() for lin in linears)
        assert [lin(x).tolist() for lin in linears] == [w.tolist() for w in want]
        assert got is not None and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        linears[1].weight = nn.Parameter(torch.zeros(4, 12, dtype=torch.bfloat16))
        assert stack(x) is None, "a rebound parameter: the linears run one by one"
    assert StackedLinear.of([nn.Linear(12, 4), nn.Linear(10, 4)], ops) is None, "different inputs"


def test_ops_refuse_what_they_cannot_take(ops):
    x = torch.randn(3, 8)
    w = torch.ones(8)
    assert FusedOps(torch.device("meta")).rms_norm(x, w, 1e-5) is None, "another device: torch's ops"
    assert ops.rms_norm(x, w.double(), 1e-5) is None, "mixed dtypes: torch's ops"
    assert ops.rms_norm(x.t().contiguous().t(), w, 1e-5) is None, "no unit stride: torch's ops"
    assert ops.silu_mul(x, torch.randn(3, 9)) is None
    q, k = torch.randn(2, 2, 4), torch.randn(2, 1, 4)
    cos = sin = torch.randn(2, 4)
    cache = torch.zeros(2, 3, 4, 1, 4)
    assert not ops.rope_write_kv(q, k, k, cos, sin, cache, torch.tensor([0, 1], dtype=torch.int32))
    assert not ops.rope_write_kv(q, k, k, cos, sin, cache, torch.tensor([0]))  # fewer slots than tokens
    assert not ops.rope_write_kv(q, k, k, cos, sin, torch.zeros(2, 3, 4, 2, 4), torch.tensor([0, 1]))
    assert torch.equal(cache, torch.zeros_like(cache)), "a refused write writes nothing"


def test_the_capability_check_gives_no_ops_without_cuda(monkeypatch):
    assert fused_ops_for("cpu") is None
    assert fused_ops_for("cuda", "torch") is None
    monkeypatch.setenv("WARMCAP_FUSED_OPS", "torch")  # the config's default when none is given
    assert fused_ops_for("cuda") is None
    with pytest.raises(Exception, match="fused_ops 'fast' is not a fused-ops mode"):
        fused_ops_for("cuda", "fast")


def test_custom_ops_have_fake_implementations(ops):
    # A fake-tensor run (graphs/proof/safety.py, torch.compile) sees each op with its output shapes.
    with FakeTensorMode():
        x, w = torch.empty(3, 8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
        assert ops.rms_norm(x, w, 1e-5).shape == (3, 8)
        h, n = ops.add_rms_norm(x, x, w, 1e-5)
        assert h.shape == n.shape == (3, 8)
        assert ops.silu_mul(x, x).shape == (3, 8)
        q, k = torch.empty(3, 2, 8), torch.empty(3, 1, 8)
        cos = torch.empty(3, 8)
        assert ops.rope_write_kv(
            q, k, k, cos, cos, torch.empty(2, 4, 2, 1, 8), torch.empty(3, dtype=torch.int64)
        )
        assert ops.greedy_argmax(torch.empty(3, 50)).shape == (3,)


def _tiny_engine(dtype: str):
    from warmcap.engine import LLMEngine
    from warmcap.llm import build_config

    config = build_config(
        "tiny-llama", device="cpu", dtype=dtype, enforce_eager=True, max_model_len=256, max_num_seqs=2
    )
    return LLMEngine(config, startup_hooks=[])


@pytest.mark.slow
def test_a_model_on_the_fused_ops_generates_the_reference_tokens_and_logs_every_kv_write(ops, monkeypatch):
    from warmcap.models.fused_ops import attach_fused_ops
    from warmcap.runner_v2.attention import torch_paged
    from warmcap.sampling_params import SamplingParams

    for env in ("WARMCAP_CPU_LAYER_OPS", "WARMCAP_CPU_GEMM", "WARMCAP_CPU_ATTENTION"):
        monkeypatch.setenv(env, "torch")  # the path CUDA runs: torch's ops where no fused op applies
    prompts = [{"prompt_token_ids": list(range(3, 22))}, {"prompt_token_ids": list(range(40, 46))}]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2
    want = [o.outputs[0].token_ids for o in _tiny_engine("float32").generate(prompts, params)]

    engine = _tiny_engine("float32")
    attach_fused_ops(engine.runner.model, ops)
    caches = engine.runner.kv_caches.tensors
    with torch.inference_mode():
        for cache in caches.values():
            cache.fill_(float("nan"))

    def backend_write(*args, **kwargs):
        raise AssertionError("the layer wrote K/V itself: the backend must not write them again")

    monkeypatch.setattr(torch_paged, "write_kv_slots", backend_write)
    with engine.runner.recording_kv_writes(True) as log:
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert got == want

    # Invariant I2 with the fused write: the slots the log recorded are exactly the slots written.
    recorded = {int(s) for r in log.records for s in r.slot_mapping.tolist() if s >= 0}
    assert recorded, "the passes were recorded"
    for layer, cache in caches.items():
        keys = cache[0].reshape(-1, cache.shape[3] * cache.shape[4])
        written = set(torch.nonzero(~keys.isnan().all(dim=1)).flatten().tolist())
        sink = (cache.shape[1] - 1) * cache.shape[2]
        assert written - {sink} == recorded, (
            f"{layer}: slots written but not logged, or logged but not written"
        )


@pytest.mark.slow
def test_gpu_checks_fused_ops_body_runs_on_cpu(monkeypatch):
    # gpu_check's fused_ops check, on CPU under the interpreter, so it cannot rot unseen.
    from warmcap.devtools.device_check.fused import fused_op_comparison

    for env in ("WARMCAP_CPU_LAYER_OPS", "WARMCAP_CPU_GEMM", "WARMCAP_CPU_ATTENTION"):
        monkeypatch.setenv(env, "torch")
    result = fused_op_comparison(device="cpu", model="tiny-llama")
    assert result["ok"], result
    steps = result["decode_step"]
    assert steps["fused"]["ops_per_layer"] < steps["torch"]["ops_per_layer"]
    assert steps["fused"]["greedy_head"] == "FusedGreedyHead"
