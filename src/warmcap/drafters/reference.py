"""Plain references for drafter parity (invariant I6): no paging, no KV cache, no batching.

Each function takes one request's full accepted token sequence (prompt + outputs, the last one
being the token just sampled) and recomputes everything from position 0 at every draft step.
The paged drafters must propose exactly what these return.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from warmcap.drafters.dflash import DFlashHead
from warmcap.drafters.heads import DraftHead, Eagle3Head


@dataclass(slots=True)
class DenseContext:
    """A stand-in for ``ForwardContext``: causal attention over the whole sequence, every call."""

    aux_hidden_state_layers: tuple[int, ...] = ()
    aux_hidden_states: list[torch.Tensor] = field(default_factory=list)

    def attention(
        self,
        layer_name: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        t = q.shape[0]
        pos = torch.arange(t, device=q.device)
        allowed = pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            allowed &= pos[None, :] > pos[:, None] - sliding_window
        return _sdpa(q, k, v, allowed, scale)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def _ids(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.int64, device=device)


def target_states(target: Any, tokens: Sequence[int], aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The target's final hidden states over ``tokens`` or, with ``aux_layers``, the concatenation
    of those layers' inputs: ``[len(tokens), H * n]``."""
    device = next(target.parameters()).device
    ids = _ids(tokens, device)
    ctx = DenseContext(aux_hidden_state_layers=aux_layers)
    hidden = target.forward(ids, torch.arange(len(ids), device=device), ctx)
    return torch.cat(ctx.aux_hidden_states, dim=-1) if aux_layers else hidden


@torch.inference_mode()
def reference_draft_model(draft: Any, tokens: Sequence[int], k: int) -> list[int]:
    """k greedy tokens of the draft LM, recomputing the whole sequence for each."""
    seq = list(tokens)
    device = next(draft.parameters()).device
    for _ in range(k):
        ids = _ids(seq, device)
        hidden = draft.forward(ids, torch.arange(len(seq), device=device), DenseContext())
        seq.append(int(draft.compute_logits(hidden[-1:]).argmax(dim=-1)))
    return seq[len(tokens) :]


@torch.inference_mode()
def reference_hidden_head(
    head: DraftHead, target: Any, tokens: Sequence[int], k: int, aux_layers: tuple[int, ...] = ()
) -> list[int]:
    """EAGLE / EAGLE-3 / MTP: position p pairs token p+1 with the target state at p; after the real
    positions, each draft extends the sequence with the head's own previous output."""
    device = next(target.parameters()).device
    states = target_states(target, tokens[:-1], aux_layers)
    if isinstance(head, Eagle3Head):
        states = head.fc(states)
    ids = list(tokens[1:])
    drafts: list[int] = []
    for _ in range(k):
        out = head.step(_ids(ids, device), torch.arange(len(ids), device=device), states, DenseContext())
        last = out[-1:]
        draft = int(head.draft_tokens(last))
        drafts.append(draft)
        ids.append(draft)
        states = torch.cat([states, last], dim=0)
    return drafts


@torch.inference_mode()
def reference_dflash(
    head: DFlashHead, target: Any, tokens: Sequence[int], k: int, aux_layers: tuple[int, ...]
) -> list[int]:
    """DFlash: context K/V from target states at positions ``0 .. n-2``, the block
    ``[tokens[-1], mask * k]`` at ``n-1 .. n-1+k`` attending to everything, non-causally."""
    device = next(target.parameters()).device
    n = len(tokens)
    ctx = head.hidden_norm(head.fc(target_states(target, tokens[:-1], aux_layers)))
    ctx_cos, ctx_sin = head.rotary.cos_sin(torch.arange(n - 1, device=device), ctx.dtype)
    x = head.embed(_ids([tokens[-1]] + [head.mask_token_id] * k, device))
    cos, sin = head.rotary.cos_sin(torch.arange(n - 1, n + k, device=device), x.dtype)
    everything = torch.ones(k + 1, n + k, dtype=torch.bool, device=device)
    for layer in head.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        kc, vc = attn.kv(ctx, ctx_cos, ctx_sin)
        kb, vb = attn.kv(h, cos, sin)
        o = _sdpa(attn.query(h, cos, sin), torch.cat([kc, kb]), torch.cat([vc, vb]), everything, attn.scale)
        x = x + attn.o_proj(o.reshape(x.shape[0], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head.draft_tokens(head.norm(x)[1:]).tolist()
