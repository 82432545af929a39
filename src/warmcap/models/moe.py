"""DeepSeek-V3 mixture of experts: sigmoid router with grouped top-k, routed experts, shared experts.

Routing per token (DeepSeek-V3 config fields):
1. ``scores = sigmoid(x @ gate.weight.T)`` in float32;
2. the *choice* scores add ``e_score_correction_bias`` (it steers which experts win, not how much
   they weigh);
3. experts are split into ``n_group`` groups; a group's rank is the sum of its two best choice
   scores; only the best ``topk_group`` groups stay eligible;
4. the ``num_experts_per_tok`` best eligible experts are picked; their weights are the *uncorrected*
   scores, renormalised to sum 1 when ``norm_topk_prob``, times ``routed_scaling_factor``.

Experts are stored stacked (``[E, I, H]``) and loaded from the per-expert checkpoint names
(``mlp.experts.N.gate_proj.weight`` ...).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from warmcap.models.layers import GatedMLP, activation

_EXPERT_WEIGHT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k])."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    per_group = choice.view(num_tokens, n_group, num_experts // n_group)
    group_rank = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
    kept_groups = group_rank.topk(topk_group, dim=-1).indices
    group_ok = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, kept_groups, True)
    eligible = group_ok[:, :, None].expand_as(per_group).reshape(num_tokens, num_experts)
    ids = choice.masked_fill(~eligible, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class RoutedExperts(nn.Module):
    """``E`` gated MLPs applied to the tokens routed to each, weighted and summed.

    Graph-safe: a static loop over every expert with each token's routing weight for that expert
    (zero when not routed), so shapes and control flow never depend on the routing.

    NOTE: the cost is dense over experts: every expert runs on every token, ``E / top_k`` times the
    FLOPs of a sparse dispatch (4x on the tiny presets, 32x for DeepSeek-V3's 256 experts, 8 picked).
    That is the price of a torch reference with static shapes; a grouped-GEMM kernel with a fixed
    per-expert capacity is what recovers sparse cost on a GPU.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = activation(act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights [T, k] and distinct expert ids [T, k] -> [T, H]."""
        shape = (x.shape[0], self.gate_proj.shape[0])
        routed = x.new_zeros(shape, dtype=torch.bool).scatter_(1, ids, True)
        dense_weights = x.new_zeros(shape).scatter_(1, ids, weights.to(x.dtype))
        out = torch.zeros_like(x)
        for expert in range(shape[1]):
            h = self.act(x @ self.gate_proj[expert].T) * (x @ self.up_proj[expert].T)
            h = (h @ self.down_proj[expert].T) * dense_weights[:, expert, None]
            # NOTE: select, not multiply by zero: an unrouted token's expert output may overflow
            # (half precision) and inf * 0 would poison the sum. Adding exact zeros keeps each
            # routed contribution's sum order (ascending expert id) the same as a sparse dispatch.
            out += torch.where(routed[:, expert, None], h, 0.0)
        return out


class DeepseekMoE(nn.Module):
    """Router + routed experts + (optional) shared experts, HF module names."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden, num_experts = hf_config.hidden_size, hf_config.n_routed_experts
        self.top_k = hf_config.num_experts_per_tok
        self.n_group = hf_config.n_group or 1
        self.topk_group = hf_config.topk_group or 1
        self.norm_topk_prob = bool(hf_config.norm_topk_prob)
        self.scaling = float(hf_config.routed_scaling_factor)
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # A checkpoint entry, not a trained weight: a parameter so the loader fills it (no buffers on meta).
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        self.experts = RoutedExperts(
            num_experts, hidden, hf_config.moe_intermediate_size, hf_config.hidden_act
        )
        self.shared_experts: GatedMLP | None = None
        if hf_config.n_shared_experts:
            shared = hf_config.moe_intermediate_size * hf_config.n_shared_experts
            self.shared_experts = GatedMLP(hidden, shared, hf_config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.float() @ self.gate.weight.float().T
        weights, ids = route(
            logits,
            self.gate.e_score_correction_bias,
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            scaling=self.scaling,
        )
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def stacked_expert_target(name: str) -> tuple[str, int] | None:
    """``...experts.7.up_proj.weight`` -> (``...experts.up_proj``, 7); None for other names."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    return f"{match['prefix']}.{match['proj']}", int(match["idx"])
