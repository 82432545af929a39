"""Drafter heads conditioned on the target's hidden states: EAGLE, EAGLE-3 and MTP.

Each head is one decoder layer over a fused input; it returns the hidden state fed to its next
step (the residual stream before any final norm) and picks draft tokens from it. Parameter names
follow the public checkpoint layouts so a head directory loads one-to-one:

- EAGLE (``yuhuili/EAGLE-LLaMA3-Instruct-8B`` style): ``fc`` over ``[embed; hidden]``,
  ``layers.0.*`` (no input norm in layer 0), logits from the target's LM head without a final norm.
- EAGLE-3: ``fc`` over three concatenated target layers, ``midlayer.*`` whose attention reads
  ``[input_layernorm(embed); hidden_norm(hidden)]``, ``norm``, its own ``lm_head`` over a draft
  vocabulary and ``d2t`` (draft id -> target id offset).
- MTP (DeepSeek style): ``enorm`` / ``hnorm``, ``eh_proj`` over ``[enorm(embed); hnorm(hidden)]``,
  one decoder layer ``layer.*``, ``shared_head.norm``; embedding and LM head shared with the target.
  On a DeepSeek target (:class:`DeepseekMTPHead`) the layer is a DeepSeek layer (MLA + MoE) and the
  weights are the checkpoint's own MTP layer (``model.layers.{num_hidden_layers}.*``).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from warmcap.contracts import ForwardContext
from warmcap.core.kv_spec import FullAttentionSpec, IndexerSpec, KVSpec, MLASpec
from warmcap.models.deepseek_v3 import DeepseekDecoderLayer, mtp_layer_state, num_mtp_layers
from warmcap.models.layers import GatedMLP, RMSNorm
from warmcap.models.rope import RotaryEmbedding, apply_rope, rope_parameters


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def head_rotary(cfg: Any, head_dim: int) -> RotaryEmbedding:
    """The target's RoPE for a head's own (Llama-style) attention, over the whole head: a target
    that rotates only part of each head (Bamba's ``partial_rotary_factor``) gives its base only."""
    params = rope_parameters(cfg)
    if params.get("partial_rotary_factor", 1.0) == 1.0:
        return RotaryEmbedding.from_config(cfg, head_dim)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim
    return RotaryEmbedding(head_dim, "default", base, 1.0 / (base**exponents))


class HeadAttention(nn.Module):
    """Self-attention of a drafter layer; ``in_dim`` may exceed the hidden size (EAGLE-3)."""

    def __init__(self, cfg: Any, in_dim: int, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(cfg)
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        k, v = self.kv(x, cos, sin)
        out = ctx.attention(self.layer_name, self.query(x, cos, sin), k, v, scale=self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def spec(self, block_size: int, dtype: torch.dtype) -> KVSpec:
        return FullAttentionSpec(
            block_size=block_size,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
        )


class HeadLayer(nn.Module):
    """Pre-norm decoder layer; ``attn_in_dim`` and the optional input norm vary by head kind."""

    def __init__(
        self, cfg: Any, layer_name: str, *, input_norm: bool = True, attn_in_dim: int | None = None
    ) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps) if input_norm else None
        self.self_attn = HeadAttention(cfg, attn_in_dim or hidden, layer_name)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        attn_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_in is None:
            attn_in = self.input_layernorm(h) if self.input_layernorm is not None else h
        h = h + self.self_attn(attn_in, cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Layer(HeadLayer):
    """EAGLE-3's layer: attention over ``[input_layernorm(embed); hidden_norm(h)]`` (twice as wide)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg, "midlayer.self_attn", attn_in_dim=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetTiedHead(nn.Module):
    """Common part: the target's embedding and LM head (shared, not owned), RoPE, attention layers."""

    def __init__(self, cfg: Any, target: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        # NOTE: plain attributes, not submodules: the target owns these weights.
        object.__setattr__(self, "target", target)
        self.rotary = head_rotary(cfg, _head_dim(cfg))

    @property
    def attention_layers(self) -> list[HeadAttention]:
        return [m for m in self.modules() if isinstance(m, HeadAttention)]

    @property
    def kv_layer_names(self) -> list[str]:
        """Layer names the head's forward passes to its KV caches (keys of ``kv_layer_specs``)."""
        return [a.layer_name for a in self.attention_layers]

    def kv_layer_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVSpec]:
        return {a.layer_name: a.spec(block_size, dtype) for a in self.attention_layers}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(input_ids)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft ids in the target vocabulary from step outputs ``[N, H]``."""
        return self.target.compute_logits(hidden).argmax(dim=-1)

    def checkpoint_state(self, target_dir: Callable[[], Path]) -> dict[str, torch.Tensor] | None:
        """Weights for this head that ship inside the target's checkpoint (``target_dir()``), used
        when no head directory is given; None: there are none (the head starts random)."""
        return None


class DraftHead(TargetTiedHead, metaclass=ABCMeta):
    """A head applied step by step: its own output feeds its next step."""

    @abstractmethod
    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """One forward over ``input_ids`` paired with ``hidden`` (target or own states); returns the
        hidden state the next step consumes."""


class EagleHead(DraftHead):
    """EAGLE: ``fc([embed(x); h])`` -> one decoder layer (no input norm) -> target LM head."""

    def __init__(self, cfg: Any, target: nn.Module, *, fc_bias: bool = False) -> None:
        super().__init__(cfg, target)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([HeadLayer(cfg, "layers.0.self_attn", input_norm=False)])

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        x = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))
        return self.layers[0](x, cos, sin, ctx)


class Eagle3Head(DraftHead):
    """EAGLE-3: ``fc`` over three target layers on the first step; attention over
    ``[input_layernorm(embed); hidden_norm(h)]``; own final norm, LM head and draft vocabulary."""

    def __init__(self, cfg: Any, target: nn.Module, *, draft_vocab_size: int | None = None) -> None:
        super().__init__(cfg, target)
        hidden = cfg.hidden_size
        vocab = draft_vocab_size or cfg.vocab_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.int64))

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        layer = self.midlayer
        attn_in = torch.cat([layer.input_layernorm(self.embed(input_ids)), layer.hidden_norm(hidden)], dim=-1)
        return layer(hidden, cos, sin, ctx, attn_in=attn_in)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(self.norm(hidden)).float().argmax(dim=-1)
        return draft + self.d2t[draft]


class MTPHead(DraftHead):
    """DeepSeek-style multi-token prediction module, applied recursively for k steps."""

    def __init__(self, cfg: Any, target: nn.Module) -> None:
        super().__init__(cfg, target)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = self.make_layer(cfg, target)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)

    def make_layer(self, cfg: Any, target: nn.Module) -> nn.Module:
        """The decoder layer between ``eh_proj`` and ``shared_head`` (a Llama-style one here)."""
        return HeadLayer(cfg, "layer.self_attn")

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(hidden)], dim=-1))
        return self.layer(x, cos, sin, ctx)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(self.shared_head.norm(hidden)).argmax(dim=-1)


class DeepseekMTPHead(MTPHead):
    """DeepSeek-V3 multi-token prediction: ``eh_proj([enorm(embed); hnorm(h)])`` -> one DeepSeek
    decoder layer (MLA over its own latent cache, MoE) -> ``shared_head.norm`` -> target LM head.

    The layer keeps the checkpoint's index (``model.layers.{num_hidden_layers}``), so its KV group is
    ``draft.mla`` (plus ``draft.indexer`` on a sparse V3.2 target).
    """

    def __init__(self, cfg: Any, target: nn.Module) -> None:
        super().__init__(cfg, target)
        # The target's RoPE (qk_rope_head_dim wide, YaRN-scaled as configured).
        self.rotary = target.rotary

    def make_layer(self, cfg: Any, target: nn.Module) -> nn.Module:
        return DeepseekDecoderLayer(target.hf_config, target.hf_config.num_hidden_layers)

    @property
    def kv_layer_names(self) -> list[str]:
        return list(self.kv_layer_specs(1, torch.float32))

    def kv_layer_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVSpec]:
        cfg = self.target.hf_config
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        attn = self.layer.self_attn
        specs: dict[str, KVSpec] = {
            attn.layer_name: MLASpec(
                block_size, dtype_bytes, kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim
            )
        }
        if attn.indexer is not None:
            specs[attn.indexer.layer_name] = IndexerSpec(
                block_size, dtype_bytes, head_size=cfg.index_head_dim
            )
        return specs

    def checkpoint_state(self, target_dir: Callable[[], Path]) -> dict[str, torch.Tensor] | None:
        # A DeepSeek checkpoint may carry its MTP layers after the decoder layers.
        if not num_mtp_layers(self.target.hf_config):
            return None
        return mtp_layer_state(target_dir(), self.target.hf_config)
