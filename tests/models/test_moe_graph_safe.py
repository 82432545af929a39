"""DeepSeek MoE with static shapes: same output as a sparse per-expert dispatch, and graph-safe (runs
under FakeTensorMode, where host reads of device data and data-dependent shapes raise)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from warmcap.models.moe import DeepseekMoE, RoutedExperts, route

HOST_SYNC_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)


class SparseDispatch(RoutedExperts):
    """The former eager path: each expert that received tokens runs on exactly those tokens."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            token, slot = torch.nonzero(ids == expert, as_tuple=True)
            h = x[token]
            h = self.act(h @ self.gate_proj[expert].T) * (h @ self.up_proj[expert].T)
            h = (h @ self.down_proj[expert].T) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, h)
        return out


def sparse_twin(experts: RoutedExperts) -> SparseDispatch:
    """A :class:`SparseDispatch` with ``experts``' weights (same dtype)."""
    num_experts, intermediate, hidden = experts.gate_proj.shape
    twin = SparseDispatch(num_experts, hidden, intermediate, "silu").to(experts.gate_proj.dtype)
    twin.load_state_dict(experts.state_dict())
    return twin


def tiny_moe(seed: int, dtype: torch.dtype = torch.float32, n_shared_experts: int = 1) -> DeepseekMoE:
    """8 experts in 4 groups, 2 groups kept, 2 experts per token; random weights."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=n_shared_experts, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    moe = DeepseekMoE(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    moe.to(dtype)
    moe.gate.float()  # routing stays float32, as in DeepseekV3ForCausalLM
    return moe


def routing(moe: DeepseekMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return route(
        x.float() @ moe.gate.weight.T,
        moe.gate.e_score_correction_bias,
        top_k=moe.top_k,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=moe.norm_topk_prob,
        scaling=moe.scaling,
    )


def run_fake(module: torch.nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """``module(*inputs)`` with its weights and every input as fake tensors: any host read of device
    data or data-dependent shape raises."""
    mode = FakeTensorMode()
    state = {
        n: mode.from_tensor(t) for n, t in itertools.chain(module.named_parameters(), module.named_buffers())
    }
    fakes = tuple(mode.from_tensor(t) for t in inputs)
    with mode, torch.no_grad():
        return torch.func.functional_call(module, state, fakes)


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, 100])
def test_static_expert_loop_matches_sparse_dispatch(num_tokens: int) -> None:
    """Bit-equal for one token (the same GEMM shapes); otherwise the only difference is that a GEMM
    over all tokens may round a row differently from one over the routed subset (≤ 1e-6 relative)."""
    for seed in range(4):
        moe = tiny_moe(seed)
        x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(100 + seed))
        weights, ids = routing(moe, x)
        with torch.no_grad():
            got, want = moe.experts(x, weights, ids), sparse_twin(moe.experts)(x, weights, ids)
        if num_tokens == 1:
            assert torch.equal(got, want)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-6, f"seed {seed}: max |diff| / max |ref| = {rel:.3g}"


def test_bfloat16_output_equals_sparse_dispatch_bit_for_bit() -> None:
    moe = tiny_moe(7, torch.bfloat16)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    weights, ids = routing(moe, x)
    with torch.no_grad():
        assert torch.equal(moe.experts(x, weights, ids), sparse_twin(moe.experts)(x, weights, ids))


def test_an_unrouted_expert_that_overflows_does_not_poison_the_output() -> None:
    """float16: expert 0 overflows to inf on every token; tokens not routed to it stay finite and
    equal the sparse dispatch (which never runs expert 0 on them)."""
    moe = tiny_moe(3, n_shared_experts=0)
    with torch.no_grad():
        moe.experts.gate_proj[0].fill_(30.0)
        moe.experts.up_proj[0].fill_(30.0)
    moe.experts.half()
    x = torch.rand(40, 32, generator=torch.Generator().manual_seed(3)).half() + 1.0
    weights, ids = routing(moe, x)
    away = ~(ids == 0).any(-1)
    assert away.any() and (~away).any(), "the draw must route some tokens to expert 0 and some away"
    with torch.no_grad():
        got, want = moe.experts(x, weights, ids), sparse_twin(moe.experts)(x, weights, ids)
    assert torch.isfinite(got[away]).all()
    torch.testing.assert_close(got[away], want[away], atol=0, rtol=1e-3)


@pytest.mark.parametrize("num_tokens", [1, 24])
def test_moe_forward_is_graph_safe(num_tokens: int) -> None:
    moe = tiny_moe(0)
    out = run_fake(moe, torch.randn(num_tokens, 32))
    assert out.shape == (num_tokens, 32) and out.dtype == torch.float32


def test_checker_catches_the_sparse_dispatch_host_sync() -> None:
    """Negative control: the former path (unique + nonzero) cannot run on fake tensors."""
    moe = tiny_moe(0)
    x = torch.randn(8, 32)
    weights, ids = routing(moe, x)
    with pytest.raises(HOST_SYNC_ERRORS):
        run_fake(sparse_twin(moe.experts), x, weights, ids)
