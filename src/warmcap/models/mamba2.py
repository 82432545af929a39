"""Mamba2 mixer weights and projections (HF layout); the conv + SSD recurrence over the paged
per-request states runs in the :class:`~warmcap.contracts.backends.MambaBackend` the runner
registered for the ``mamba`` KV kind, found through :meth:`ForwardContext.backend`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from warmcap.contracts.backends import MambaBackend, MambaWeights
from warmcap.contracts.forward_context import ForwardContext
from warmcap.contracts.metadata import MambaMetadata
from warmcap.core.kv_spec import KVSpec, MambaSpec
from warmcap.models.decoder import KVSettings
from warmcap.models.layers import activation


class GatedGroupRMSNorm(nn.Module):
    """``rmsnorm(y * silu(gate))`` with the norm taken over each of ``groups`` equal slices."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups = groups
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(gate.float())
        h = h.view(*h.shape[:-1], self.groups, -1)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.flatten(-2).to(dtype)


class Mamba2Mixer(nn.Module):
    """HF Mamba2 mixer weights (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
    ``out_proj``); Bamba's ``mamba_*`` config fields."""

    def __init__(self, hf_config: Any, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.mamba_n_heads
        self.head_dim = hf_config.mamba_d_head
        self.n_groups = hf_config.mamba_n_groups
        self.d_state = hf_config.mamba_d_state
        self.d_conv = hf_config.mamba_d_conv
        self.chunk_size = hf_config.mamba_chunk_size
        self.inner = hf_config.mamba_expand * hidden
        self.conv_dim = self.inner + 2 * self.n_groups * self.d_state
        self.dt_limit = tuple(getattr(hf_config, "time_step_limit", None) or (0.0, float("inf")))
        self.act = activation(hf_config.hidden_act)
        bias = bool(getattr(hf_config, "mamba_proj_bias", False))
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_dim + self.num_heads, bias=bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.d_conv,
            groups=self.conv_dim,
            bias=bool(getattr(hf_config, "mamba_conv_bias", True)),
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedGroupRMSNorm(self.inner, self.n_groups, hf_config.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, hidden, bias=bias)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv window, SSM state) shapes of one request's state."""
        return (self.conv_dim, self.d_conv - 1), (self.num_heads, self.head_dim, self.d_state)

    def kv_specs(self, kv: KVSettings) -> dict[str, KVSpec]:
        """This layer's state slots: ``1 + num_speculative_blocks`` per request (k draft tokens).

        The block size is ``kv.block_size`` in cache modes ``all``/``align`` (a state is kept per
        block); in mode ``none`` it is ``max_model_len`` when given, so one block spans the whole
        context and a request holds ``1 + k`` state blocks (the runner's Mamba state handler plans
        the columns).
        """
        block_size = kv.block_size
        if kv.mamba_cache_mode == "none" and kv.max_model_len is not None:
            block_size = kv.max_model_len
        spec = MambaSpec(
            block_size,
            kv.dtype_bytes,
            state_shapes=self.state_shapes,
            cache_mode=kv.mamba_cache_mode,
            num_speculative_blocks=kv.num_speculative_blocks,
        )
        return {self.layer_name: spec}

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.metadata(self.layer_name)
        if not isinstance(meta, MambaMetadata):
            raise TypeError(f"{self.layer_name} needs MambaMetadata for its group; got {type(meta).__name__}")
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        weights = MambaWeights(
            conv_weight=self.conv1d.weight,
            conv_bias=self.conv1d.bias,
            a=-torch.exp(self.A_log.float()),
            d=self.D,
            activation=self.act,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            n_groups=self.n_groups,
            d_state=self.d_state,
            chunk_size=self.chunk_size,
        )
        backend = ctx.backend(self.layer_name, MambaBackend)
        y = backend.forward(xbc, dt, ctx.kv_caches[self.layer_name], meta, weights)
        return self.out_proj(self.norm(y.flatten(1).to(x.dtype), gate))
