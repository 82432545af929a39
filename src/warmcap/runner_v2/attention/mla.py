"""Paged multi-head latent attention (DeepSeek-V2/V3 MLA) in plain torch, over the latent cache.

Cache layout per MLA layer: ``[num_blocks + 1, block_size, kv_lora_rank + qk_rope_head_dim]``; each
token stores its normed latent ``c_kv`` followed by its rotated shared rope key ``k_pe``. The last
block is the sink for PAD writes (see :mod:`warmcap.contracts.metadata`).

Two equivalent ways to attend:
- *decompressed* (prefill): every context latent is expanded to per-head keys and values through
  ``kv_b_proj`` (``W_UK``, ``W_UV``) and ordinary attention runs over them;
- *absorbed* (decode): ``W_UK`` is folded into the query, attention runs directly over the latents,
  and ``W_UV`` is applied to the latent-space output. Cheaper when queries are few.

The path is chosen per batch from host metadata, so a captured graph holds one fixed path: every
token takes the absorbed path when ``meta.max_query_len <= absorbed_max_query_len`` (a decode or
short-verify batch), every token takes the decompressed one otherwise. The two agree to float
rounding, not bit for bit, so a batch's outputs can move in the last bits when its
``max_query_len`` crosses the threshold (e.g. padding it for a graph).

Everything here is graph-safe: no host reads of device tensors, no ``*_cpu`` metadata, no
data-dependent shapes. Padded tokens belong to padded rows (``seq_len`` 0), see nothing and get zeros.

The cache helpers (:mod:`warmcap.runner_v2.attention.latent_cache`) are shared with the sparse-MLA
indexer backend, which keeps its own cache in its own KV group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from warmcap.contracts.backends import MLABackend, MLAWeights
from warmcap.runner_v2.attention.latent_cache import gather_context, query_layout, visible_mask, write_slots

if TYPE_CHECKING:
    from warmcap.contracts.metadata import AttentionMetadata


class TorchMLABackend(MLABackend):
    """Paged MLA over the latent cache, in plain torch (the CPU reference; graph-safe)."""

    name = "torch_mla"

    def __init__(self, absorbed_max_query_len: int = 1) -> None:
        self.absorbed_max_query_len = absorbed_max_query_len

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        weights: MLAWeights,
        *,
        scale: float,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, Dr] (rotated), latent [T, R + Dr] (normed c_kv, rotated
        k_pe) -> [T, H, Dv]. Writes ``latent`` into ``kv_cache`` first.

        ``allowed`` [T, max_seq_len] bool restricts each query to selected context positions
        (sparse MLA); causality and sequence bounds are always applied on top.
        """
        write_slots(kv_cache, latent, meta.slot_mapping)
        if meta.num_reqs == 0 or meta.max_seq_len == 0:
            return q_nope.new_zeros(*q_nope.shape[:2], weights.w_uv.shape[1])
        context, valid = gather_context(kv_cache, meta)
        rows, positions = query_layout(meta)
        mask = visible_mask(rows, positions, valid, allowed)
        absorbed = meta.max_query_len <= self.absorbed_max_query_len
        attend = _attend_absorbed if absorbed else _attend_decompressed
        return attend(q_nope, q_pe, context, rows, mask, weights, scale).to(q_nope.dtype)


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax over the last dim of [t, H, S]; a query that sees nothing gets all zeros."""
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


def _attend_decompressed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    context: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    weights: MLAWeights,
    scale: float,
) -> torch.Tensor:
    rank = weights.w_uk.shape[-1]
    c_kv, k_pe = context[..., :rank].float(), context[..., rank:].float()
    k_nope = torch.einsum("rsc,hdc->rshd", c_kv, weights.w_uk.float())
    value = torch.einsum("rsc,hvc->rshv", c_kv, weights.w_uv.float())
    scores = torch.einsum("thd,tshd->ths", q_nope.float(), k_nope[rows])
    scores += torch.einsum("thd,tsd->ths", q_pe.float(), k_pe[rows])
    probs = _softmax(scores * scale, mask)
    return torch.einsum("ths,tshv->thv", probs, value[rows])


def _attend_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    context: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    weights: MLAWeights,
    scale: float,
) -> torch.Tensor:
    rank = weights.w_uk.shape[-1]
    c_kv, k_pe = context[rows, :, :rank].float(), context[rows, :, rank:].float()
    q_latent = torch.einsum("thd,hdc->thc", q_nope.float(), weights.w_uk.float())
    scores = torch.einsum("thc,tsc->ths", q_latent, c_kv) + torch.einsum("thd,tsd->ths", q_pe.float(), k_pe)
    probs = _softmax(scores * scale, mask)
    out_latent = torch.einsum("ths,tsc->thc", probs, c_kv)
    return torch.einsum("thc,hvc->thv", out_latent, weights.w_uv.float())
