"""The DeepSeek-V3.2 lightning indexer's selection in plain torch, over its paged key cache.

A query's score for context token s is ``sum_h w_h * relu(q_h . k_s * scale)``; the ``top_k`` best
causal positions are kept. Graph-safe: shapes depend only on host metadata (``num_tokens``,
``max_seq_len``, ``top_k``), so the selection is a fixed-size mask, never a gathered index list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from warmcap.contracts.backends import IndexerBackend
from warmcap.runner_v2.attention.latent_cache import gather_context, query_layout, visible_mask, write_slots

if TYPE_CHECKING:
    from warmcap.contracts.metadata import AttentionMetadata


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """q [t, H, D], keys [t, S, D] (each query's context), weights [t, H] -> scores [t, S] float32."""
    per_head = torch.relu(torch.einsum("thd,tsd->ths", q.float(), keys.float()) * scale)
    return torch.einsum("th,ths->ts", weights.float(), per_head)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """[t, S] scores and visibility -> [t, S] bool: the ``top_k`` best visible positions per row."""
    masked = scores.masked_fill(~visible, float("-inf"))
    k = min(top_k, masked.shape[-1])
    chosen = torch.zeros_like(visible).scatter_(1, masked.topk(k, dim=-1).indices, True)
    return chosen & visible


class TorchIndexerBackend(IndexerBackend):
    """Lightning-indexer top-k selection in plain torch (the CPU reference; graph-safe)."""

    name = "torch_indexer"

    def select(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        top_k: int,
    ) -> torch.Tensor:
        write_slots(kv_cache, k, meta.slot_mapping)
        keys, valid = gather_context(kv_cache, meta)
        rows, positions = query_layout(meta)
        visible = visible_mask(rows, positions, valid, None)
        return select_topk(index_scores(q, keys[rows], weights, scale), visible, top_k)
