"""Bamba: a Mamba2 + attention hybrid (transformers ``BambaForCausalLM`` layout).

Layer i is attention when ``i in attn_layer_indices`` (HF ``layers_block_type``), else a Mamba2
mixer; every layer then has a gated MLP (``feed_forward``). Attention is the Llama path with partial
RoPE (HF Bamba rotates the first ``partial_rotary_factor`` (0.5) of each head). Mamba layers keep
their state in a Mamba KV group (layer name ``model.layers.N.mamba``); the cache mode and the
number of speculative state slots come from the engine, see
:meth:`~warmcap.models.mamba2.Mamba2Mixer.kv_specs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from warmcap.contracts.forward_context import ForwardContext
from warmcap.errors import ModelLoadError
from warmcap.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer
from warmcap.models.layers import GatedMLP
from warmcap.models.llama import ArchTraits, LlamaAttention
from warmcap.models.mamba2 import Mamba2Mixer
from warmcap.models.rope import RotaryEmbedding, apply_rope, rope_parameters


def rotary_dim_of(hf_config: Any, head_dim: int) -> int:
    """Rotated dims per head: ``head_dim * partial_rotary_factor`` (HF Bamba hardcodes 0.5)."""
    return int(head_dim * rope_parameters(hf_config).get("partial_rotary_factor", 1.0))


def bamba_rotary(hf_config: Any) -> RotaryEmbedding:
    """Default RoPE over the first :func:`rotary_dim_of` dims of each attention head."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default":
        raise ModelLoadError(f"Bamba rope_type {params['rope_type']!r} is not supported; only 'default' is")
    rot = rotary_dim_of(hf_config, head_dim)
    # NOTE: built on CPU explicitly: models are constructed under ``torch.device("meta")``.
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rot, 2, device="cpu").to(torch.float32) / rot
    return RotaryEmbedding(rot, "default", base, 1.0 / (base**exponents))


class PartialRopeAttention(LlamaAttention):
    """Llama attention whose RoPE covers only the first ``rotary_dim`` dims of each head."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t, rot = x.shape[0], cos.shape[-1]
        q, k, v = self.project(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = torch.cat((apply_rope(q[..., :rot], cos, sin), q[..., rot:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :rot], cos, sin), k[..., rot:]), dim=-1)
        out = ctx.attention(self.layer_name, q, k, v, scale=self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class BambaDecoderLayer(PreNormDecoderLayer):
    """Attention (``self_attn``) or a Mamba2 mixer (``mamba``), then the MLP ``feed_forward``."""

    def __init__(self, hf_config: Any, layer_idx: int, is_attention: bool) -> None:
        hidden = hf_config.hidden_size
        mixer: nn.Module
        if is_attention:
            mixer = PartialRopeAttention(hf_config, layer_idx, ArchTraits())
        else:
            mixer = Mamba2Mixer(hf_config, f"model.layers.{layer_idx}.mamba")
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        super().__init__(
            hidden,
            hf_config.rms_norm_eps,
            mixer,
            GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act, bias=mlp_bias),
            mixer_name="self_attn" if is_attention else "mamba",
            mlp_name="feed_forward",
            post_norm_name="pre_ff_layernorm",
        )
        self.is_attention = is_attention

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.is_attention:
            return self.mixer(x, cos, sin, ctx)
        # Mamba takes no RoPE: position lives in its recurrent state.
        return self.mixer(x, ctx)


class BambaForCausalLM(DecoderForCausalLM):
    """Bamba hybrid causal LM: attention through ``ctx.attention``, Mamba2 state through its group's
    :class:`~warmcap.contracts.metadata.MambaMetadata`."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype = torch.float32) -> None:
        attention = set(hf_config.attn_layer_indices or ())
        layers = (BambaDecoderLayer(hf_config, i, i in attention) for i in range(hf_config.num_hidden_layers))
        model = DecoderModel(hf_config, layers, norm_name="final_layernorm")
        super().__init__(hf_config, model, bamba_rotary(hf_config), dtype=dtype)
