"""DFlash: block-parallel drafting in ONE forward over ``1 + k`` query positions.

The target's states of accepted positions become *context* K/V in the drafter's own KV group
(``draft_prefill``); then the block ``[sampled token, mask, ..., mask]`` at positions ``P .. P + k``
attends to all context and to the whole block (non-causal inside the block), and the outputs at
the k mask positions are the drafts (``draft_step_0``). The block writes position ``P + k <=
start + scheduled + k``: one slot past the EAGLE-style k, hence dflash's lookahead of k + 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from warmcap.contracts import AttentionMetadata
from warmcap.core.reservation import blocks_covering
from warmcap.drafters.base import DRAFT_DECODE, DRAFT_GROUP_PREFIX, DRAFT_PREFILL, DraftGraphShape
from warmcap.drafters.heads import HeadLayer, TargetTiedHead
from warmcap.drafters.hidden import HeadDrafter, HeadModel
from warmcap.drafters.paged import DraftContext, DraftKV, DraftPass, DraftTokens, num_drafts_allowed
from warmcap.drafters.registry import register
from warmcap.models.layers import RMSNorm
from warmcap.runner_v2.attention.torch_paged import write_kv

#: depth of a random DFlash head (published DFlash drafters use a few layers; EAGLE-style heads one)
RANDOM_DFLASH_LAYERS = 2


def block_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Every query of row ``r`` sees every key at positions ``< seq_lens[r]`` (no causal mask).

    ``q`` [T, Hq, D] in ``meta``'s row layout; keys are read through the row's block table.
    """
    r, bs, t = meta.num_reqs, meta.block_size, q.shape[0]
    cols = blocks_covering(meta.max_seq_len, bs)
    qmax = meta.max_query_len
    _, _, _, hkv, d = kv_cache.shape
    hq = q.shape[1]
    device = q.device
    blocks = meta.block_table[:r, :cols].long().reshape(-1)
    visible = torch.arange(cols * bs, device=device)[None, :] < meta.seq_lens[:r, None].long()
    # NOTE: keys past a row's length are zeroed, not only masked: 0 * NaN (a poisoned or unwritten
    # page tail) is NaN. [R, K, Hq, D]: each row's pages end to end, KV heads repeated per query head.
    unread = ~visible[:, :, None, None]
    keys = kv_cache[0].index_select(0, blocks).view(r, cols * bs, hkv, d).masked_fill_(unread, 0)
    values = kv_cache[1].index_select(0, blocks).view(r, cols * bs, hkv, d).masked_fill_(unread, 0)
    keys, values = keys.repeat_interleave(hq // hkv, dim=2), values.repeat_interleave(hq // hkv, dim=2)
    qsl = meta.query_start_loc[: r + 1].long()
    slot = torch.arange(qmax, device=device)
    # [R, Qmax] token feeding each padded query slot; padded slots repeat a real token of the row.
    index = torch.minimum(qsl[:-1, None] + slot[None, :], qsl[1:, None] - 1)
    out = F.scaled_dot_product_attention(
        q[index].transpose(1, 2),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=visible[:, None, None, :],
        scale=scale,
    )  # [R, Hq, Qmax, D]
    row = torch.repeat_interleave(torch.arange(r, device=device), qsl[1:] - qsl[:-1], output_size=t)
    return out.transpose(1, 2)[row, torch.arange(t, device=device) - qsl[row]]


class DFlashHead(TargetTiedHead):
    """``fc`` over concatenated target layers + ``hidden_norm`` -> context features; ``layers``
    of pre-norm blocks whose K/V for context come from those features; final ``norm``; the
    target's embedding and LM head."""

    def __init__(self, cfg: Any, target: nn.Module, *, num_target_states: int, mask_token_id: int) -> None:
        super().__init__(cfg, target)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.mask_token_id = mask_token_id
        self.fc = nn.Linear(num_target_states * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(
            HeadLayer(cfg, f"layers.{i}.self_attn") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, eps)

    def write_context(
        self, features: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], slots: torch.Tensor
    ) -> torch.Tensor:
        """Write the context K/V of target ``features`` [Tc, n*H] at ``slots`` in every layer;
        returns the context states [Tc, H] they were derived from."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            write_kv(cache, k, v, slots)
        return ctx

    def block(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the block queries; returns final-normed hidden states [Tb, H]."""
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = attn.kv(h, cos, sin)
            write_kv(cache, k, v, meta.slot_mapping)
            o = block_attention(attn.query(h, cos, sin), cache, meta, attn.scale)
            x = x + attn.o_proj(o.reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


class DFlashDraftModel(HeadModel):
    """The DFlash head's two passes: ``draft_prefill`` writes context K/V from target features;
    ``draft_decode`` runs the block queries over token ids."""

    head: DFlashHead

    def feature_spec(self, phase: str) -> tuple[int, torch.dtype] | None:
        if phase != DRAFT_PREFILL:
            return None
        return self.head.fc.in_features, self.dtype

    def forward_pass(
        self,
        kv: DraftKV,
        phase: str,
        metas: dict[str, AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None,
    ) -> torch.Tensor:
        """``draft_prefill``: write context K/V from ``features`` (returns the context states);
        ``draft_decode``: the block queries over ``input_ids``."""
        (group,) = self._groups
        meta = metas[group.name]
        caches = [kv.kv_caches[DRAFT_GROUP_PREFIX + a.self_attn.layer_name] for a in self.head.layers]
        if phase == DRAFT_PREFILL:
            if features is None:
                raise ValueError("dflash context passes need the target's hidden-state features")
            return self.head.write_context(features.to(self.dtype), positions, caches, meta.slot_mapping)
        return self.head.block(input_ids, positions, caches, meta)

    def greedy_drafts(self, phase: str, output: torch.Tensor) -> torch.Tensor | None:
        return self.head.draft_tokens(output) if phase == DRAFT_DECODE else None


@register
class DFlashDrafter(HeadDrafter):
    """Block-parallel drafter over its own KV group, conditioned on target layers ``aux_layers``."""

    method = "dflash"
    head: DFlashHead

    @staticmethod
    def make_head(
        cfg: Any, target: nn.Module, state: dict[str, torch.Tensor] | None, aux_layers: tuple[int, ...]
    ) -> DFlashHead:
        if state is None:
            # Published DFlash heads state their depth; a random one gets a few layers.
            cfg.num_hidden_layers = RANDOM_DFLASH_LAYERS
        mask = getattr(cfg, "mask_token_id", None)
        return DFlashHead(
            cfg, target, num_target_states=len(aux_layers), mask_token_id=int(mask if mask is not None else 0)
        )

    def make_model(self) -> DFlashDraftModel:
        shapes = [DraftGraphShape(DRAFT_PREFILL, None)]
        if self.num_speculative_tokens:  # a P/D producer's drafter runs no block pass
            shapes.append(DraftGraphShape(DRAFT_DECODE, 1 + self.num_speculative_tokens))
        return DFlashDraftModel(self.head, shapes, method=self.method)

    def propose(self, ctx: DraftContext) -> DraftTokens:
        view = ctx.view
        device = ctx.device
        if not view.req_ids:
            return DraftTokens.none(device)
        run = self.executor.run
        context = DraftPass.spans(view.req_ids, view.rows, view.start, view.num_valid)
        rows = torch.from_numpy(view.valid_state_index()).to(device)
        features = self.target_states(ctx)[rows].to(self.dtype)
        empty = torch.zeros(context.num_tokens, dtype=torch.int64, device=device)
        run(context, phase=DRAFT_PREFILL, log_phase=DRAFT_PREFILL, input_ids=empty, features=features)

        k = self.num_speculative_tokens
        budget = num_drafts_allowed(view, k, ctx.max_model_len)
        drafting = np.flatnonzero(budget > 0)
        if drafting.size == 0:
            return DraftTokens.none(device)
        blk = DraftPass.spans(
            view.req_ids, view.rows, view.next_position, np.where(budget > 0, budget + 1, 0)
        )
        firsts = blk.query_start_loc[:-1]
        ids = np.full(blk.num_tokens, self.head.mask_token_id, dtype=np.int64)
        ids[firsts] = ctx.token_ids[blk.rows, blk.positions[firsts]]
        out = run(
            blk, phase=DRAFT_DECODE, log_phase="draft_step_0", input_ids=torch.from_numpy(ids).to(device)
        )
        # The drafts are the outputs at the mask positions: request r's n_r of them, row r of an
        # [R, k] tensor; the index is built on the host and moved in one copy.
        num = budget[drafting].astype(np.int64)
        mask_rows = np.setdiff1d(np.arange(blk.num_tokens), firsts)
        req_of = np.repeat(np.arange(drafting.size), num)
        col = np.arange(int(num.sum())) - np.repeat(np.cumsum(num) - num, num)
        index = torch.from_numpy(np.stack([mask_rows, req_of, col])).to(device)
        tokens = torch.full((drafting.size, k), -1, dtype=torch.int64, device=device)
        tokens[index[1], index[2]] = self.head.draft_tokens(out[index[0]])
        return DraftTokens.from_rows(blk.req_ids, num, tokens, view.next_position[drafting] + 1)
