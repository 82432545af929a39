"""DeepSeek multi-head latent attention (MLA) layer over the paged latent cache.

The layer computes queries and the per-token latent (``c_kv`` normed, ``k_pe`` rotated), then calls
the MLA backend the runner registered for its KV kind (``ctx.backend(layer_name, MLABackend)``) with
its own cache and its KV group's metadata: MLA does not fit ``ForwardContext.attention``'s (q, k, v)
signature. When the config declares a
lightning indexer (DeepSeek-V3.2), the indexer picks the context positions each query may see.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from warmcap.contracts.backends import MLABackend, MLAWeights
from warmcap.contracts.forward_context import ForwardContext
from warmcap.core.kv_spec import IndexerSpec, KVSpec, MLASpec
from warmcap.errors import ModelLoadError
from warmcap.models.decoder import KVSettings
from warmcap.models.layers import RMSNorm
from warmcap.models.rope import apply_rope, rope_parameters
from warmcap.models.sparse_indexer import LightningIndexer


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Reorder pairs ``(x0, x1), (x2, x3) ...`` to ``(x0, x2, ..., x1, x3, ...)``: interleaved RoPE
    then equals rotate-half RoPE on the result (dot products are unchanged by the shared reorder)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def mla_softmax_scale(hf_config: Any) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim and params.get("factor", 1.0) > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """HF ``DeepseekV3Attention`` weights (``q_a_proj``/``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``,
    ``kv_b_proj``, ``o_proj``) over the paged latent cache; optional lightning indexer."""

    def __init__(self, hf_config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_name = f"model.layers.{layer_idx}.self_attn"
        self.num_heads = hf_config.num_attention_heads
        self.nope_dim = hf_config.qk_nope_head_dim
        self.rope_dim = hf_config.qk_rope_head_dim
        self.v_dim = hf_config.v_head_dim
        self.kv_lora_rank = hf_config.kv_lora_rank
        self.q_lora_rank = hf_config.q_lora_rank
        # DeepSeek-V3.2 configs drop the flag: their MLA RoPE is always interleaved.
        self.interleave = bool(getattr(hf_config, "rope_interleave", True))
        self.scale = mla_softmax_scale(hf_config)
        hidden, bias = hf_config.hidden_size, bool(getattr(hf_config, "attention_bias", False))
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.indexer: LightningIndexer | None = None
        if getattr(hf_config, "index_topk", None):
            if self.q_lora_rank is None:
                raise ModelLoadError(
                    "index_topk is set but q_lora_rank is null: the lightning indexer reads the q latent; "
                    "set q_lora_rank or drop the index_* fields"
                )
            self.indexer = LightningIndexer(hf_config, f"{self.layer_name}.indexer")

    def kv_specs(self, kv: KVSettings) -> dict[str, KVSpec]:
        """The paged latent cache, plus the indexer's key cache (its own KV group) when sparse."""
        specs: dict[str, KVSpec] = {
            self.layer_name: MLASpec(
                kv.block_size, kv.dtype_bytes, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.rope_dim
            )
        }
        if self.indexer is not None:
            specs[self.indexer.layer_name] = IndexerSpec(
                kv.block_size, kv.dtype_bytes, head_size=self.indexer.head_dim
            )
        return specs

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(deinterleave(x) if self.interleave else x, cos, sin)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        q_resid: torch.Tensor | None = None
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), self._rope(k_pe[:, None, :], cos, sin)[:, 0]), dim=-1)
        q_pe = self._rope(q_pe, cos, sin)
        allowed = None
        if self.indexer is not None and q_resid is not None:
            allowed = self.indexer(x, q_resid, cos, sin, ctx)
        weights = MLAWeights.from_kv_b_proj(self.kv_b_proj.weight, self.num_heads, self.nope_dim)
        out = ctx.backend(self.layer_name, MLABackend).forward(
            q_nope,
            q_pe,
            latent,
            ctx.kv_caches[self.layer_name],
            ctx.metadata(self.layer_name),
            weights,
            scale=self.scale,
            allowed=allowed,
        )
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim).to(x.dtype))
