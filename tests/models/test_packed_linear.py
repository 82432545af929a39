"""Prepacked linears, in either layout (oneDNN's, or the compiled GEMM's column blocks): the same
products as ``F.linear`` (to float32 rounding), applied by the loader to plain float32 CPU linears
only, and greedy generation unchanged on SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from warmcap.kernels.cpu.gemm import BlockedWeight, Gemm
from warmcap.models.batch_invariant import BatchInvariantLinear
from warmcap.models.loader import load_model
from warmcap.models.packed_linear import (
    PackedGroup,
    PackedLinear,
    can_prepack,
    packed_group,
    prepack_linears,
    prepacked_bytes,
    running_unpacked,
    unpack_linears,
)
from warmcap.models.tiny import write_tiny_model


def test_the_cpu_torch_build_has_the_packed_linear_ops() -> None:
    # The CPU wheels warmcap pins ship oneDNN; without it nothing is packed and serving is slower.
    assert can_prepack()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "tiny-llama"
    write_tiny_model("tiny-llama", path)
    return path


def layout(cpu_gemm: Gemm, blocked: bool) -> Gemm | bool:
    """``prepack_linears``' ``gemm=``: the compiled GEMM's layout, or oneDNN's."""
    return cpu_gemm if blocked else False


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 40),
    shape=st.sampled_from([(64, 96), (576, 192), (576, 1536), (1536, 576)]),
    bias=st.booleans(),
    blocked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_linear_computes_the_same_product(
    cpu_gemm: Gemm, m: int, shape, bias: bool, blocked: bool, seed: int
) -> None:
    k, n = shape
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    x = torch.randn(m, k)
    with torch.inference_mode():
        expected = linear(x)
        assert prepack_linears(linear, gemm=layout(cpu_gemm, blocked)) == 1
        got = linear(x)
    assert type(linear) is PackedLinear and got.shape == (m, n)
    assert isinstance(linear.packed_weight, BlockedWeight) == blocked
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("blocked", [True, False])
def test_packed_linear_keeps_leading_dims_and_reads_strided_inputs(cpu_gemm: Gemm, blocked: bool) -> None:
    linear = nn.Linear(32, 8)
    x = torch.randn(3, 5, 32)
    strided = torch.randn(32, 6).t()  # a transposed view, not contiguous
    expected = (linear(x), linear(strided))
    prepack_linears(linear, gemm=layout(cpu_gemm, blocked))
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(strided), expected[1], rtol=1e-5, atol=1e-5)


def test_only_plain_float32_cpu_linears_are_packed() -> None:
    model = nn.ModuleDict(
        {
            "plain": nn.Linear(8, 8),
            "bf16": nn.Linear(8, 8).to(torch.bfloat16),
            "tiled": BatchInvariantLinear(8, 8),
            "embed": nn.Embedding(10, 8),
        }
    )
    assert prepack_linears(model) == 1
    assert type(model["plain"]) is PackedLinear
    assert type(model["bf16"]) is nn.Linear and type(model["tiled"]) is BatchInvariantLinear


def packed_tensors(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for m in model.modules():
        if type(m) is PackedLinear:
            packed = m.packed_weight if m.group is None else m.group.weight
            out.append(packed.blocks if isinstance(packed, BlockedWeight) else packed)
    return out


class _Siblings(nn.Module):
    packed_groups = (("a", "b", "c"),)

    def __init__(self, k: int, sizes: tuple[int, int, int], bias: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(k, n, bias=bias) for n in sizes)


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(0, 40),
    sizes=st.sampled_from([(576, 192, 192), (1536, 1536, 8), (64, 32, 96), (20, 7, 33)]),
    bias=st.booleans(),
    blocked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_linears_give_each_members_product_bit_for_bit(
    cpu_gemm: Gemm, m: int, sizes, bias: bool, blocked: bool, seed: int
) -> None:
    """One GEMM over the siblings' concatenated weights equals each member packed alone, exactly:
    fusing q/k/v or gate/up must not move a single greedy token."""
    torch.manual_seed(seed)
    alone, grouped = _Siblings(576, sizes, bias), _Siblings(576, sizes, bias)
    grouped.load_state_dict(alone.state_dict())
    x = torch.randn(m, 576)
    with torch.inference_mode():
        gemm = layout(cpu_gemm, blocked)
        assert prepack_linears(alone, groups=False, gemm=gemm) == 3  # each alone: no group
        assert packed_group(alone.a, alone.b, alone.c) is None
        assert prepack_linears(grouped, gemm=gemm) == 3
        group = packed_group(grouped.a, grouped.b, grouped.c)
        assert isinstance(group, PackedGroup)
        for got, member_alone, member in zip(
            group(x), (alone.a, alone.b, alone.c), (grouped.a, grouped.b, grouped.c), strict=True
        ):
            assert torch.equal(got, member_alone(x))
            assert torch.equal(member(x), got)  # a member called alone runs the group
    # in the wrong order, or with a member run unpacked, there is no group to call
    assert packed_group(grouped.b, grouped.a, grouped.c) is None
    with running_unpacked([grouped.b]):
        assert packed_group(grouped.a, grouped.b, grouped.c) is None


def test_siblings_with_bias_on_some_only_are_packed_one_by_one() -> None:
    model = _Siblings(16, (8, 8, 8), bias=True)
    model.b.bias = None
    assert prepack_linears(model) == 3
    assert packed_group(model.a, model.b, model.c) is None
    assert all(m.packed_weight is not None and m.group is None for m in (model.a, model.b, model.c))


def test_loader_packs_by_default_and_never_in_batch_invariant_mode(tiny_llama: Path, cpu_gemm: Gemm) -> None:
    packed = load_model(tiny_llama)
    tiled = load_model(tiny_llama, batch_invariant=True)
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    # where the compiled GEMM builds (the cpu_gemm fixture says it does), the loader uses its layout
    assert all(m.gemm is not None for m in linears)
    assert all(isinstance(t, torch.Tensor) for t in packed_tensors(packed))
    # q/k/v and gate/up of every layer run as one GEMM each
    for layer in packed.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert packed_group(attn.q_proj, attn.k_proj, attn.v_proj) is not None
        assert packed_group(mlp.gate_proj, mlp.up_proj) is not None
    assert not any(isinstance(m, PackedLinear) for m in tiled.modules())
    # The parameters are untouched: same names, same values as the unpacked checkpoint.
    assert packed.state_dict().keys() == tiled.state_dict().keys()
    for name, value in packed.state_dict().items():
        assert torch.equal(value, tiled.state_dict()[name]), name


def test_kv_sizing_counts_the_packed_copies_the_same_on_meta_and_loaded(tiny_llama: Path) -> None:
    """The pool is sized before loading (``warmup plan``, meta device) and after (``warmup run``):
    both must subtract the packed copies, or the KV cache would take memory the weights hold."""
    from warmcap.config import EngineConfig, ModelConfig
    from warmcap.kv_layout import meta_model

    loaded = load_model(tiny_llama)
    meta, _ = meta_model(tiny_llama, EngineConfig(model=ModelConfig(model=str(tiny_llama))))
    cpu = torch.device("cpu")
    # grouped linears (q/k/v, gate/up) share one packed tensor: count each tensor once
    copies = {id(t): t for t in packed_tensors(loaded)}.values()
    held = sum(t.numel() * t.element_size() for t in copies)
    assert prepacked_bytes([loaded], cpu, batch_invariant=False) == prepacked_bytes(
        [meta], cpu, batch_invariant=False
    )
    assert prepacked_bytes([meta], cpu, batch_invariant=False) >= held > 0
    # nothing is packed in batch-invariant mode, so nothing is counted
    assert prepacked_bytes([meta], cpu, batch_invariant=True) == 0


def test_unpack_restores_plain_linears_bit_for_bit(tiny_llama: Path) -> None:
    model = load_model(tiny_llama)
    linear = next(m for m in model.modules() if isinstance(m, PackedLinear))
    x = torch.randn(7, linear.in_features)
    assert unpack_linears(model) > 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert not hasattr(linear, "packed_weight")
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_greedy_tokens_are_unchanged_by_packing() -> None:
    from warmcap.llm import LLM
    from warmcap.sampling_params import SamplingParams

    llm = LLM("smollm2-135m", device="cpu", max_num_seqs=4, max_model_len=256, enforce_eager=True)
    model = llm.engine.model
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis in one sentence.",
        "List three prime numbers.",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    packed = [o.token_ids for o in llm.generate(prompts, params)]
    unpack_linears(model)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert packed == plain
