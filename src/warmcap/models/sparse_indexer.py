"""DeepSeek-V3.2 lightning indexer: picks the top-k context tokens each query attends to.

Each token stores one key vector (``index_head_dim``) in the indexer's own paged cache, a separate
KV group (layer name ``model.layers.N.self_attn.indexer``, :class:`~warmcap.core.kv_spec.IndexerSpec`).
A query's score for context token s is ``sum_h w_h * relu(q_h . k_s) * index_head_dim ** -0.5`` with
``w = weights_proj(x) * index_n_heads ** -0.5``; the ``index_topk`` best causal positions are kept.
RoPE covers the first ``qk_rope_head_dim`` dims of the queries and keys, rotate-half style.

The layer computes queries, keys and head weights; the indexer backend the runner registered for
the ``indexer`` KV kind stores the keys and makes the selection (a fixed-size mask, graph-safe).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from warmcap.contracts.backends import IndexerBackend
from warmcap.contracts.forward_context import ForwardContext
from warmcap.models.rope import apply_rope


class LightningIndexer(nn.Module):
    """HF ``DeepseekV32Indexer`` weights: ``wq_b``, ``wk``, ``k_norm`` (LayerNorm), ``weights_proj``."""

    def __init__(self, hf_config: Any, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = hf_config.index_n_heads
        self.head_dim = hf_config.index_head_dim
        self.rope_dim = hf_config.qk_rope_head_dim
        self.top_k = hf_config.index_topk
        self.wq_b = nn.Linear(hf_config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hf_config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hf_config.hidden_size, self.num_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """-> [T, max_seq_len] bool: the context positions each query may attend to.

        Writes this step's keys into the indexer cache through the indexer group's slot mapping.
        """
        t = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(t, self.num_heads, self.head_dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(x))[:, None, :], cos, sin)[:, 0]
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        return ctx.backend(self.layer_name, IndexerBackend).select(
            q,
            k,
            weights,
            ctx.kv_caches[self.layer_name],
            ctx.metadata(self.layer_name),
            scale=self.head_dim**-0.5,
            top_k=self.top_k,
        )
